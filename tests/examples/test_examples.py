"""examples/ launched as users launch them: torchrun with 2 processes, and 2 jax.distributed processes.

Each must finish, print falling losses, and reproduce the runner its launcher stands in for:
torchrun's world the spawned gloo world of ``launch_torch``, the two JAX processes the 2-device
mesh of ``train_jax``. Same frontend, same arithmetic in the same order (one thread per rank;
a psum and an all-gather of 2 operands are exact), so those must agree bit for bit. Between the
two frameworks, the parity tolerances of tests/parity apply.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.demo import TrainConfig, launch_torch, train_jax
from hybrid.demo._torch_run import free_port
from tests._procs import finish

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
TIMEOUT_S = 150


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets its own
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _finish(procs, what: str) -> list[str]:
    return finish(procs, what, timeout_s=TIMEOUT_S)


def _printed_losses(out: str) -> np.ndarray:
    found = [(int(s), float(x)) for s, x in re.findall(r"^step (\d+) loss ([0-9.]+)$", out, re.M)]
    assert [s for s, _ in found] == list(range(STEPS)), out[-4000:]
    losses = np.array([x for _, x in found])
    assert losses[-5:].mean() < 0.8 * losses[:5].mean(), f"losses do not fall: {losses}"
    assert f"done: {STEPS} steps on 2 ranks" in out
    return losses


def _saved(path: Path):
    with np.load(path) as f:
        return f["losses"], {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("param/")}


@pytest.fixture(scope="module")
def torchrun_example(tmp_path_factory):
    out_file = tmp_path_factory.mktemp("torchrun") / "result.npz"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "examples" / "torch_train.py"), "--steps", str(STEPS),
           "--out", str(out_file)]
    (out,) = _finish([subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)], "torchrun")
    return _printed_losses(out), _saved(out_file)


@pytest.fixture(scope="module")
def jax_example(tmp_path_factory):
    out_file = tmp_path_factory.mktemp("jax") / "result.npz"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "jax_train.py"), "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), "--steps",
                               str(STEPS), "--out", str(out_file)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = _finish(procs, "jax_train.py")
    return _printed_losses(outs[0]), _saved(out_file)


def _assert_same(saved, result, what: str) -> None:
    losses, params = saved
    np.testing.assert_array_equal(losses, result.losses, err_msg=f"{what}: losses")
    assert list(params) == list(result.params)
    for name in params:
        np.testing.assert_array_equal(params[name], result.params[name], err_msg=f"{what}: {name}")


def test_torchrun_example_equals_spawned_world(torchrun_example):
    printed, saved = torchrun_example
    np.testing.assert_allclose(printed, saved[0], atol=5e-7)  # printed with 6 decimals
    _assert_same(saved, launch_torch(TrainConfig(num_steps=STEPS), world_size=2), "torchrun vs launch_torch")


def test_jax_distributed_example_equals_one_process_mesh(jax_example):
    printed, saved = jax_example
    np.testing.assert_allclose(printed, saved[0], atol=5e-7)
    _assert_same(saved, train_jax(TrainConfig(num_steps=STEPS), num_devices=2), "2 processes vs 2 devices")


def test_examples_agree_across_frameworks(torchrun_example, jax_example):
    (t_losses, t_params), (j_losses, j_params) = torchrun_example[1], jax_example[1]
    np.testing.assert_allclose(t_losses, j_losses, rtol=1e-5, atol=1e-6)
    for name in t_params:
        np.testing.assert_allclose(t_params[name], j_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
