"""``python -m hybrid demo``, run as a user runs it: a subprocess, its output, its files, its exit code."""

import os
import pathlib
import subprocess
import sys

import pytest

from hybrid import cli
from hybrid.cli.demo import default_out
from tests._xla import QUICK_CODEGEN_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo(*args, cwd, env=None):
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # The demo asks for the host devices it needs, as from a fresh shell (no device count here);
    # compiled as the suite compiles (tests/_xla.py)
    env["XLA_FLAGS"] = QUICK_CODEGEN_FLAGS
    return subprocess.run([sys.executable, "-m", "hybrid", "demo", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=170)


def _loss_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) in (4, 6)]


def test_the_gpt_pair_trains_at_default_caps_compares_hands_over_and_plots(tmp_path):
    # The default model, the default output folder: the user's cache, never the folder it runs in.
    (tmp_path / "clone").mkdir()
    proc = _demo("--steps", "6", "--save-at", "3", cwd=tmp_path / "clone", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # stderr is a pipe here, as in a log: whole progress lines, no progress bar's carriage returns
    assert "\r" not in proc.stderr and "torch  DDP + ZeRO-1, 2 gloo ranks: step 6/6, loss " in proc.stderr
    assert "GPT pair" in out and "470,528 parameters in 28 tensors" in out
    # torch's default caps: a 1 MiB first bucket of 16 tensors, the rest in a second; equal plans
    assert "Tensors per bucket: 16 + 12." in out and "(equal)" in out
    fingerprints = out.split("Plan fingerprints: torch ")[1].split(" (")[0].split(", jax ")
    assert fingerprints[0] == fingerprints[1]
    assert float(out.split("max |torch - jax| of the loss ")[1].split()[0]) < 1e-5
    assert "resumed torch's step-3 checkpoint" in out and "loss max |resumed - torch| " in out
    rows = _loss_rows(out)
    assert [int(r[0]) for r in rows] == list(range(6)) and [len(r) for r in rows] == [4] * 3 + [6] * 3
    assert not any((tmp_path / "clone").iterdir()), "the demo wrote into the folder it ran in"
    where = tmp_path / "cache" / "hybrid" / "demo" / "gpt"
    assert (where / "checkpoint" / "manifest.json").exists()
    png = where / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"parity: {png}" in out


def test_the_mlp_stays_an_option_and_a_second_demo_on_the_same_folder_is_refused(tmp_path):
    """Two runs at once would overwrite each other's checkpoint and plot: the second is told which
    run holds the folder and how to give it its own. Once the folder is released the MLP runs
    there (one demo run checks both: a run is most of this file's time)."""
    import fcntl

    from hybrid.cli.demo import LOCK_NAME
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK_NAME, "w") as held:
        held.write("pid 4242, started 2026-11-27 12:00:00\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = _demo("--model", "mlp", "--steps", "2", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 1
    assert f"another python -m hybrid demo is writing to {out} (pid 4242, started 2026-11-27 12:00:00)" \
        in proc.stderr and "--out DIR" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "checkpoint").exists()
    # released: it runs. One torch rank and 2 resuming devices: the cheapest world, and not the
    # default sizes.
    proc = _demo("--model", "mlp", "--steps", "4", "--world-size", "1", "--resume-world-size", "2", "--batch-size", "8",
                 "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "twin MLP 16-32-32-4" in proc.stdout and "Tensors per bucket: 6." in proc.stdout
    assert "(equal)" in proc.stdout and [len(r) for r in _loss_rows(proc.stdout)] == [4] * 2 + [6] * 2
    assert (tmp_path / "out" / "loss_curves.png").exists()


def test_stage_3_trains_the_gpt_pair_on_one_plan(tmp_path):
    # torch ZeRO3 and hybrid.jax's stage 3 over shard_params, through the GPT's pairing: one plan
    proc = _demo("--stage", "3", "--steps", "4", "--save-at", "2", "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Bucket caps: ZeRO3's default plan" in out and "torch ZeRO3's (hybrid.core.zero3_plan" in out
    assert "Tensors per bucket: 16 + 12." in out and "(equal)" in out
    assert float(out.split("max |torch - jax| of the loss ")[1].split()[0]) < 1e-5
    assert "resumed torch's step-2 checkpoint" in out and "ZeRO3, 2 gloo ranks" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--steps", "1"], "argument --steps: must be an integer >= 2, got '1'"),
    (["--steps", "ten"], "argument --steps: must be an integer >= 2, got 'ten'"),
    (["--world-size", "0"], "argument --world-size: must be an integer >= 1, got '0'"),
    (["--resume-world-size", "0"], "argument --resume-world-size: must be an integer >= 1, got '0'"),
    (["--batch-size", "-4"], "argument --batch-size: must be an integer >= 1, got '-4'"),
    (["--save-at", "0"], "argument --save-at: must be an integer >= 1, got '0'"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got 'inf'"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0, got '0'"),
    (["--lr=-1e-3"], "argument --lr: must be a finite number > 0, got '-1e-3'"),
    (["--lr", "fast"], "argument --lr: must be a finite number > 0, got 'fast'"),
    (["--stage", "4"], "argument --stage: invalid choice: 4"),
    (["--model", "cnn"], "argument --model: invalid choice: 'cnn'"),
    (["--world-size", "5"], "--world-size 5 must divide --batch-size 12"),
    (["--resume-world-size", "5"], "--resume-world-size 5 must divide --batch-size 12"),
    (["--batch-size", "10"], "--resume-world-size 3 must divide --batch-size 10"),  # world size 2 + 1
    (["--model", "mlp", "--world-size", "5"], "--world-size 5 must divide --batch-size 48"),
    (["--save-at", "40"], "--save-at must be in 1..39 (a step before --steps 40), got 40"),
    (["--steps", "4", "--save-at", "7"], "--save-at must be in 1..3 (a step before --steps 4), got 7"),
])
def test_every_numeric_option_is_checked_before_anything_runs(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "usage: python -m hybrid demo" in err, err


def test_a_bad_option_is_a_usage_error_not_a_traceback(tmp_path):
    for bad in (["--resume-world-size", "0"], ["--lr", "nan"]):
        proc = _demo(*bad, cwd=tmp_path)
        assert proc.returncode == 2 and "error: argument " + bad[0] in proc.stderr and "Traceback" not in proc.stderr
        assert not any(tmp_path.iterdir())


def test_the_default_output_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_out("gpt") == tmp_path / "hybrid" / "demo" / "gpt"
    for unusable in ("", "relative/cache"):  # XDG: an empty or relative value is ignored
        monkeypatch.setenv("XDG_CACHE_HOME", unusable)
        assert default_out("mlp") == pathlib.Path.home() / ".cache" / "hybrid" / "demo" / "mlp"


def test_demo_failure_is_a_message_and_exit_1(tmp_path):
    (tmp_path / "taken").write_text("a file where the output folder should go")
    proc = _demo("--steps", "4", "--out", "taken", cwd=tmp_path)
    assert proc.returncode == 1
    assert "hybrid demo failed: FileExistsError" in proc.stderr and "Traceback" not in proc.stderr


def test_progress_is_a_bar_on_a_terminal_and_whole_lines_in_a_log(monkeypatch):
    import io

    from hybrid.cli.demo import PlainProgress, _bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    assert type(_bar("torch", 3)).__name__ == "tqdm"
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    bar = _bar("torch", 40)
    assert isinstance(bar, PlainProgress)
    with bar:
        for step in range(40):
            bar.update(1)
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("torch: step 40/40, loss 0.0250, ")  # every 4th step
    assert "\r" not in log.getvalue()
