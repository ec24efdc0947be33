"""examples/ launched as users launch them: torchrun with 2 processes, and 2 jax.distributed processes.

Each must finish, print falling losses, and reproduce the runner its launcher stands in for:
torchrun's world the spawned gloo world of ``launch_torch``, the two JAX processes the 2-device
mesh of ``train_jax``. Same frontend, same arithmetic in the same order (one thread per rank;
a psum and an all-gather of 2 operands are exact), so those must agree bit for bit. Between the
two frameworks, the parity tolerances of tests/parity apply.

The JAX run also saves a checkpoint halfway (``--save-at``), and 3 processes resume it
(``--resume``): on the same global batches they must follow the 2-process run, which went on
uninterrupted, within rtol 1e-6 / atol 1e-7 (tests/checkpoint/test_resume's tolerance: 3 devices
only add the gradient mean's float32 terms in another order).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests._xla import QUICK_CODEGEN_FLAGS

import numpy as np
import pytest

from hybrid.checkpoint import Checkpoint
from hybrid.demo import TrainConfig, launch_torch, train_jax
from hybrid.demo._torch_run import free_port
from tests._procs import finish

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_AT = 20, 10
BATCH = 48  # split evenly over 2 and 3 processes
TIMEOUT_S = 150


def _env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = QUICK_CODEGEN_FLAGS  # the example adds its device count; compiled as this process compiles
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _finish(procs, what: str) -> list[str]:
    return finish(procs, what, timeout_s=TIMEOUT_S)


def _printed_losses(out: str, *, start: int = 0, ranks: int = 2) -> np.ndarray:
    found = [(int(s), float(x)) for s, x in re.findall(r"^step (\d+) loss ([0-9.]+)$", out, re.M)]
    assert [s for s, _ in found] == list(range(start, STEPS)), out[-4000:]
    losses = np.array([x for _, x in found])
    assert start or losses[-5:].mean() < 0.8 * losses[:5].mean(), f"losses do not fall: {losses}"
    assert f"done: {STEPS - start} steps on {ranks} ranks" in out
    return losses


def _saved(path: Path):
    with np.load(path) as f:
        return f["losses"], {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("param/")}


@pytest.fixture(scope="module")
def torchrun_example(tmp_path_factory):
    d = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "examples" / "torch_train.py"), "--steps", str(STEPS),
           "--batch-size", str(BATCH), "--out", str(d / "result.npz"), "--save", str(d / "ckpt"),
           "--save-at", str(SAVE_AT)]
    (out,) = _finish([subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)], "torchrun")
    return _printed_losses(out), _saved(d / "result.npz"), d / "ckpt"


def _jax_job(num_processes: int, *args) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "jax_train.py"), "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", str(num_processes), "--process-id", str(i),
                               "--steps", str(STEPS), "--batch-size", str(BATCH), *map(str, args)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    return _finish(procs, "jax_train.py")


@pytest.fixture(scope="module")
def jax_example(tmp_path_factory):
    d = tmp_path_factory.mktemp("jax")
    outs = _jax_job(2, "--out", d / "result.npz", "--save", d / "ckpt", "--save-at", SAVE_AT)
    return _printed_losses(outs[0]), _saved(d / "result.npz"), d / "ckpt"


def _assert_same(saved, result, what: str) -> None:
    losses, params = saved
    np.testing.assert_array_equal(losses, result.losses, err_msg=f"{what}: losses")
    assert list(params) == list(result.params)
    for name in params:
        np.testing.assert_array_equal(params[name], result.params[name], err_msg=f"{what}: {name}")


def test_torchrun_example_equals_spawned_world(torchrun_example):
    printed, saved, _ = torchrun_example
    np.testing.assert_allclose(printed, saved[0], atol=5e-7)  # printed with 6 decimals
    _assert_same(saved, launch_torch(TrainConfig(num_steps=STEPS, global_batch_size=BATCH), world_size=2),
                 "torchrun vs launch_torch")


def test_jax_distributed_example_equals_one_process_mesh(jax_example):
    printed, saved, _ = jax_example
    np.testing.assert_allclose(printed, saved[0], atol=5e-7)
    _assert_same(saved, train_jax(TrainConfig(num_steps=STEPS, global_batch_size=BATCH), num_devices=2),
                 "2 processes vs 2 devices")


def test_examples_agree_across_frameworks(torchrun_example, jax_example):
    (t_losses, t_params), (j_losses, j_params) = torchrun_example[1], jax_example[1]
    assert len(t_losses) == len(j_losses) == STEPS
    np.testing.assert_allclose(t_losses, j_losses, rtol=1e-5, atol=1e-6)
    for name in t_params:
        np.testing.assert_allclose(t_params[name], j_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # --save-at: both scripts saved step SAVE_AT, each process its own file.
    t_ckpt, j_ckpt = Checkpoint(torchrun_example[2]), Checkpoint(jax_example[2])
    assert [(c.manifest.framework, c.manifest.world_size, c.manifest.step) for c in (t_ckpt, j_ckpt)] == \
        [("torch", 2, SAVE_AT), ("jax", 2, SAVE_AT)]
    for kind in ("params", "mu", "nu"):
        t, j = t_ckpt.tensors(kind), j_ckpt.tensors(kind)
        for name in t:
            np.testing.assert_allclose(t[name], j[name], rtol=1e-4, atol=1e-5, err_msg=f"{kind} {name}")


def test_jax_example_resumes_at_another_process_count(jax_example, tmp_path):
    _, (losses, params), ckpt = jax_example
    outs = _jax_job(3, "--resume", ckpt, "--out", tmp_path / "resumed.npz")
    printed = _printed_losses(outs[0], start=SAVE_AT, ranks=3)
    resumed_losses, resumed_params = _saved(tmp_path / "resumed.npz")
    np.testing.assert_allclose(printed, resumed_losses, atol=5e-7)
    np.testing.assert_allclose(resumed_losses, losses[SAVE_AT:], rtol=1e-6, atol=1e-7)
    for name in params:
        np.testing.assert_allclose(resumed_params[name], params[name], rtol=1e-6, atol=1e-7, err_msg=name)
    loss_diff = np.max(np.abs(resumed_losses - losses[SAVE_AT:]))
    param_diff = max(np.max(np.abs(resumed_params[k] - params[k])) for k in params)
    print(f"JAX 2 -> 3 processes, resumed at step {SAVE_AT} of {STEPS} vs the 2-process run uninterrupted: "
          f"losses differ by at most {loss_diff:.3g}, final parameters by {param_diff:.3g}")


def test_jax_example_at_stage_3_saves_across_processes_and_resumes(tmp_path):
    """ZeRO stage 3 under jax.distributed: no process holds the parameters whole, so each writes its
    devices' slices of them (as of Adam's moments). The 2-process run equals the 2-device mesh of
    one process bit for bit; 3 processes resume its step-10 checkpoint within the resume tolerance
    above (3 devices, another sharding of the same plan)."""
    outs = _jax_job(2, "--stage", 3, "--out", tmp_path / "run.npz", "--save", tmp_path / "ckpt", "--save-at", SAVE_AT)
    _printed_losses(outs[0])
    losses, params = _saved(tmp_path / "run.npz")
    _assert_same((losses, params), train_jax(TrainConfig(num_steps=STEPS, global_batch_size=BATCH, stage=3),
                                             num_devices=2), "stage 3: 2 processes vs 2 devices")
    manifest = Checkpoint(tmp_path / "ckpt").manifest
    assert (manifest.framework, manifest.stage, manifest.world_size, manifest.step) == ("jax", 3, 2, SAVE_AT)
    outs = _jax_job(3, "--stage", 3, "--resume", tmp_path / "ckpt", "--out", tmp_path / "resumed.npz")
    _printed_losses(outs[0], start=SAVE_AT, ranks=3)
    resumed_losses, resumed_params = _saved(tmp_path / "resumed.npz")
    np.testing.assert_allclose(resumed_losses, losses[SAVE_AT:], rtol=1e-6, atol=1e-7)
    for name in params:
        np.testing.assert_allclose(resumed_params[name], params[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_crashed_torchrun_job_relaunched_goes_on_from_its_newest_checkpoint(torchrun_example, tmp_path):
    """The recovery docs/torch-api.md gives (torchrun's --max-restarts fails on gloo): launched with
    --checkpoint-dir and --save-every, the job crashes after step 11 (--fail-at); the same command
    launched again resumes from step-000008, the newest complete checkpoint, and ends where the
    uninterrupted run ends, bit for bit (2 ranks: a 2-operand all-reduce is exact, so the fresh
    DDP's first bucket does not matter)."""
    def torchrun(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(ROOT / "examples" / "torch_train.py"), "--steps", str(STEPS),
               "--batch-size", str(BATCH), "--checkpoint-dir", str(tmp_path / "ckpts"), "--save-every", "4", *extra]
        return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)

    crashed = torchrun("--fail-at", "11")
    assert crashed.returncode != 0 and "crashing after step 10 (--fail-at 11)" in crashed.stdout, crashed.stdout[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step-000004", "step-000008"]
    relaunched = torchrun("--out", str(tmp_path / "result.npz"))
    assert relaunched.returncode == 0, relaunched.stdout[-3000:] + relaunched.stderr[-3000:]
    assert f"resuming from {tmp_path / 'ckpts' / 'step-000008'} (step 8)" in relaunched.stdout
    _printed_losses(relaunched.stdout, start=8)
    losses, params = _saved(tmp_path / "result.npz")
    uninterrupted_losses, uninterrupted = torchrun_example[1]
    np.testing.assert_array_equal(losses, uninterrupted_losses[8:])
    for name in uninterrupted:
        np.testing.assert_array_equal(params[name], uninterrupted[name], err_msg=name)
    assert (tmp_path / "ckpts" / "step-000020").exists()  # it went on saving
