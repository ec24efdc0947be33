"""``python -m hybrid demo``, run as a user runs it: a subprocess, its output, its files, its exit code."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)  # the demo asks for the host devices it needs, as from a fresh shell
    return subprocess.run([sys.executable, "-m", "hybrid", "demo", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=170)


def test_demo_trains_compares_hands_over_and_plots(tmp_path):
    proc = _demo("--steps", "8", "--save-at", "5", "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "plan " in out and "flat shard of ranks 0..1" in out
    assert "Plan fingerprints: torch" in out and "(equal)" in out
    parity = float(out.split("over all parameters after 8 steps: ")[1].split()[0])
    assert parity < 1e-4
    assert "jax, resumed" in out and "resumed at 3 devices" in out
    # One row per step, the resumed column filled from the checkpoint's step on.
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) in (4, 6)]
    assert [int(r[0]) for r in rows] == list(range(8)) and [len(r) for r in rows] == [4] * 5 + [6] * 3
    assert (tmp_path / "out" / "checkpoint" / "manifest.json").exists()
    png = tmp_path / "out" / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"Plot of the loss curves: out/loss_curves.png" in out
    assert "step/s" in proc.stderr  # tqdm's bars


def test_demo_refuses_bad_options_clearly(tmp_path):
    proc = _demo("--world-size", "5", cwd=tmp_path)
    assert proc.returncode != 0 and "--world-size 5 must be >= 1 and divide --batch-size 48" in proc.stderr


def test_demo_failure_is_a_message_and_exit_1(tmp_path):
    (tmp_path / "taken").write_text("a file where the output folder should go")
    proc = _demo("--steps", "4", "--out", "taken", cwd=tmp_path)
    assert proc.returncode == 1
    assert "hybrid demo failed: FileExistsError" in proc.stderr and "Traceback" not in proc.stderr
