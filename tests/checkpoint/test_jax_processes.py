"""hybrid.checkpoint.jax across the processes of a jax.distributed job (gloo CPU collectives).

The twin model of hybrid.demo trained with hybrid.jax.zero over a mesh of every process's
devices: saved by 2 and by 3 processes, resumed at another process count (2 -> 3, 3 -> 2 with two
local devices each), in one process, and in torch. As in test_resume: training on after a resume
follows the uninterrupted run within rtol 1e-6 / atol 1e-7 in JAX (another device count only
changes the order of float32 additions in the gradient mean) and within the parity tolerance in
torch (losses rtol 1e-5 / atol 1e-6, parameters rtol 1e-4 / atol 1e-5: the frameworks' float32
kernels round differently). The oracle of the files themselves: what 2 processes write is, byte
for byte, what one process writes for the same state on 2 devices.

The 2 x 2-device job also checks stage-3 parameters born sharded across its processes (their
``init_shards``, save and load into ``abstract_shards``: ``_jax_born_sharded.py``): JAX processes
are most of this file's time, so a job is started once and handed both checks.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hybrid.checkpoint import Checkpoint, read_state
from hybrid.checkpoint import jax as ckpt
from hybrid.demo import TrainConfig, jax_params, train_jax, train_torch
from tests._procs import finish, start_jax_job
from tests._procs import torch_world

HERE = Path(__file__).parent
STEPS, SAVE = 12, 6
CONFIG = dict(global_batch_size=48, num_steps=STEPS)  # 48 rows: 1, 2, 3 and 4 devices split them evenly
SAME = dict(rtol=1e-6, atol=1e-7)
PARITY_LOSS = dict(rtol=1e-5, atol=1e-6)
PARITY_PARAMS = dict(rtol=1e-4, atol=1e-5)
TIMEOUT_S = 120


def _start(num_processes: int, local_devices: int, job: dict) -> list:
    return start_jax_job(HERE / "_jax_mp_worker.py", num_processes, local_devices, json.dumps(job))


def _train(d: Path, name: str, num_processes: int, local_devices: int, config: dict, **train) -> dict:
    """Train in a job of ``num_processes``; returns process 0's losses, start step and params."""
    job = {"config": config, "train": {k: str(d / v) if k != "save_at" else v for k, v in train.items()},
           "out": str(d / f"{name}.npz")}
    if name == "jax2":
        job["plain"] = str(d / "plain")
    if name == "jax2x2":
        job["born_sharded"] = str(d / "born")
    outs = finish(_start(num_processes, local_devices, job), name, timeout_s=TIMEOUT_S)
    with np.load(d / f"{name}.npz") as f:
        return {"losses": f["losses"], "start_step": int(f["start_step"]), "outs": outs,
                "params": {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("param/")}}


def _result(r) -> dict:
    return {"losses": r.losses, "start_step": r.start_step, "params": r.params}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("jax-processes")
    out = {"dir": d}
    # 2 processes x 1 device: saves at step 6 and trains on, uninterrupted, to 12.
    out["jax2"] = _train(d, "jax2", 2, 1, CONFIG, save_to="jax2", save_at=SAVE)
    # 2 -> 3 processes (stage 2): resumes at 6, saves again at 9.
    out["jax3"] = _train(d, "jax3", 3, 1, {**CONFIG, "stage": 2}, resume="jax2", save_to="jax3", save_at=9)
    # 3 -> 2 processes holding 2 devices each; then stage-3 parameters born sharded over them.
    out["jax2x2"] = _train(d, "jax2x2", 2, 2, CONFIG, resume="jax3")
    # One process (a single-controller mesh of 2 devices) from the 3-process checkpoint; and the
    # 2-process run again in one process, saving the same state at step 6.
    out["one_process"] = _result(train_jax(TrainConfig(**CONFIG), num_devices=2, resume=str(d / "jax3")))
    out["one_process_save"] = _result(train_jax(TrainConfig(**CONFIG), num_devices=2, save_to=str(d / "one"),
                                                save_at=SAVE))
    # torch, 2 gloo ranks (forked from the test run's preloaded forkserver), from the 3-process checkpoint.
    out["torch"] = _result(torch_world(train_torch, TrainConfig(**CONFIG), world_size=2, resume=str(d / "jax3")))
    return out


def test_processes_write_the_bytes_one_process_writes(runs):
    d = runs["dir"]
    np.testing.assert_array_equal(runs["jax2"]["losses"], runs["one_process_save"]["losses"])
    assert (d / "jax2" / "manifest.json").read_text() == (d / "one" / "manifest.json").read_text()
    for f in Checkpoint(d / "jax2").manifest.files:
        assert (d / "jax2" / f.name).read_bytes() == (d / "one" / f.name).read_bytes(), f.name
    m = Checkpoint(d / "jax3").manifest
    assert (m.framework, m.world_size, m.stage, m.step, m.optimizer.count) == ("jax", 3, 2, 9, 9)
    Checkpoint(d / "jax3").verify()


# (resumed run, the run it continues, the step it resumed at, tolerances)
HAND_OVERS = {
    "2 -> 3 processes": ("jax3", "jax2", SAVE, SAME, SAME),
    "3 processes -> 2 x 2 devices": ("jax2x2", "jax3", 9, SAME, SAME),
    "3 processes -> one process": ("one_process", "jax3", 9, SAME, SAME),
    "3 JAX processes -> torch": ("torch", "jax3", 9, PARITY_LOSS, PARITY_PARAMS),
}


@pytest.mark.parametrize("hand_over", list(HAND_OVERS))
def test_resumed_run_follows_the_uninterrupted_one(runs, hand_over):
    resumed, reference, start, loss_tol, params_tol = HAND_OVERS[hand_over]
    new, ref = runs[resumed], runs[reference]
    assert new["start_step"] == start and len(new["losses"]) == STEPS - start
    ref_losses = ref["losses"][start - ref["start_step"]:]
    np.testing.assert_allclose(new["losses"], ref_losses, **loss_tol)
    for k in ref["params"]:
        np.testing.assert_allclose(new["params"][k], ref["params"][k], **params_tol, err_msg=k)
    worst = max(np.max(np.abs(new["params"][k] - ref["params"][k])) for k in ref["params"])
    print(f"{hand_over}: losses differ by at most {np.max(np.abs(new['losses'] - ref_losses)):.3g}, "
          f"final parameters by {worst:.3g}")


def test_unsharded_state_dealt_to_processes(runs):
    """2 processes cut a replicated optax state into 3 files (process 0 writes ranks 0 and 2)."""
    params = jax_params(runs["jax2"]["params"])
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    loaded, state, step = ckpt.load(runs["dir"] / "plain", zeros, optax.adam(1e-2).init(zeros))
    assert step == 7 and int(state[0].count) == 7 and Checkpoint(runs["dir"] / "plain").manifest.world_size == 3
    for got, want in ((loaded, params), (state[0].mu, jax.tree_util.tree_map(lambda x: 2 * x, params)),
                      (state[0].nu, jax.tree_util.tree_map(jnp.square, params))):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert read_state(runs["dir"] / "plain") == {"epoch": 1}
    assert ckpt.load_buffers(runs["dir"] / "plain", {"bn": {"mean": jnp.zeros(3)}})["bn"]["mean"].tolist() == [0.5] * 3


def test_born_sharded_and_loaded_across_processes(runs):
    """2 processes of 2 devices: ``init_shards`` over the global mesh, a save, and a load into
    ``abstract_shards``: each process holds (and reads) only its devices' slices, bit for bit those
    ``shard_params`` cuts from the jitted init (``_jax_born_sharded.py`` checks them)."""
    for i, out in enumerate(runs["jax2x2"]["outs"]):
        assert f"process {i}: born sharded ok, " in out and "over 4 devices" in out, out[-2000:]
