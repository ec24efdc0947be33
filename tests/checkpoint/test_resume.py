"""A run moves between frameworks and world sizes through one checkpoint and trains on.

The twin model of hybrid.demo: torch (DDP + ZeroRedundancyOptimizer / ZeRO2, gloo ranks) and
JAX (hybrid.jax.zero over host devices). A load followed by a save gives back the checkpoint's
tensors bitwise (resharding moves elements, it computes nothing). Training on after a resume
follows the uninterrupted run within rtol 1e-6 inside one framework (another world size only
changes the order of float32 additions in the gradient mean) and within the parity tolerance
across frameworks (losses rtol 1e-5 / atol 1e-6, parameters rtol 1e-4 / atol 1e-5, as
tests/parity: the frameworks' float32 kernels round differently).

The torch runs start worlds of their own: the world size a checkpoint is saved at and loaded into
is the subject, and each of 2, 3, 1 and 2 ranks is started once (the two 3-rank runs share one
world). Their ranks are forked from the test run's preloaded forkserver (``tests._procs.torch_world``), not
fresh interpreters each importing torch as ``launch_torch`` / ``spawn_world`` start them.
"""

import numpy as np
import pytest

import hybrid.demo as demo  # train_jax on use: the torch ranks import this module and need no jax
from hybrid.checkpoint import Checkpoint
from hybrid.demo import TrainConfig, train_torch
from tests._procs import torch_world

STEPS, SAVE = 12, 6
# 48 rows split evenly over 1, 2 and 3 ranks or devices.
CONFIG = dict(global_batch_size=48, num_steps=STEPS)
SAME = dict(rtol=1e-6, atol=1e-7)
PARITY_LOSS = dict(rtol=1e-5, atol=1e-6)
PARITY_PARAMS = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    out = {"dir": d}
    # torch, 2 ranks, ZeRO-1: saves at step 6 and trains on, uninterrupted, to 12.
    out["torch2"] = torch_world(train_torch, TrainConfig(**CONFIG), world_size=2, save_to=str(d / "torch2"),
                                save_at=SAVE)
    # 2 -> 3: torch ZeRO2 on 3 ranks from the 2-rank checkpoint; saves again at step 9. The same
    # 3-rank world then loads the 2-rank checkpoint and saves it with no step between (torch_copy).
    out["torch3"], out["torch_copy"] = torch_world(_torch3_then_copy, str(d), world_size=3)
    # 3 -> 1 within torch.
    out["torch1"] = torch_world(train_torch, TrainConfig(**CONFIG), world_size=1, resume=str(d / "torch3"))
    # torch -> JAX: 3 host devices, stage 2, from the 2-rank torch checkpoint; saves at step 9.
    out["jax3"] = demo.train_jax(TrainConfig(**CONFIG, stage=2), num_devices=3, resume=str(d / "torch2"),
                            save_to=str(d / "jax3"), save_at=9)
    # JAX -> torch: the 3-device JAX checkpoint on 2 torch ranks.
    out["torch2_from_jax"] = torch_world(train_torch, TrainConfig(**CONFIG), world_size=2, resume=str(d / "jax3"))
    # JAX 3 -> JAX 1.
    out["jax1"] = demo.train_jax(TrainConfig(**CONFIG), num_devices=1, resume=str(d / "jax3"))
    # Load and save with no step in between, in both frameworks at other world sizes (torch's: above).
    demo.train_jax(TrainConfig(global_batch_size=48, num_steps=SAVE), num_devices=4, resume=str(d / "torch2"),
              save_to=str(d / "jax_copy"), save_at=SAVE)
    # ... and on as many devices as the saving run, with its config: the same files.
    demo.train_jax(TrainConfig(**CONFIG, stage=2), num_devices=3, resume=str(d / "jax3"), save_to=str(d / "jax3_again"),
              save_at=9)
    return out


def _torch3_then_copy(d: str, progress=None):
    """Both 3-rank torch runs in one world (a world's processes are most of a run's time here):
    ZeRO2 resumed from torch2 and trained to step 12, saving at 9; then torch2 loaded and saved
    again at its step, with no step between."""
    torch3 = train_torch(TrainConfig(**CONFIG, stage=2), resume=f"{d}/torch2", save_to=f"{d}/torch3", save_at=9)
    copy = train_torch(TrainConfig(global_batch_size=48, num_steps=SAVE, stage=2), resume=f"{d}/torch2",
                       save_to=f"{d}/torch_copy", save_at=SAVE)
    return torch3, copy


@pytest.mark.parametrize("copy", ["torch_copy", "jax_copy"])
def test_load_then_save_is_bitwise(runs, copy):
    """The tensors, through another world size and stage (so other files: the bytes cannot match,
    nor the run state, which this does not read). At the same world size the files themselves,
    manifest and DDP record included: test_resume_buckets.py."""
    src, dst = Checkpoint(runs["dir"] / "torch2"), Checkpoint(runs["dir"] / copy)
    assert dst.manifest.world_size == (3 if copy == "torch_copy" else 4) and dst.manifest.step == SAVE
    assert dst.manifest.optimizer.count == src.manifest.optimizer.count == SAVE
    for kind in ("params", "mu", "nu"):
        a, b = src.tensors(kind), dst.tensors(kind)
        assert list(a) == list(b)
        for name in a:
            assert np.array_equal(a[name], b[name]), (kind, name)


def test_jax_load_then_save_at_the_same_device_count_gives_back_the_same_bytes(runs):
    """docs/moving-runs.md's claim for JAX (torch's: test_resume_buckets.py): every file, manifest included."""
    src, dst = runs["dir"] / "jax3", runs["dir"] / "jax3_again"
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    for f in src.iterdir():
        assert (dst / f.name).read_bytes() == f.read_bytes(), f.name


def test_manifest_records_the_run(runs):
    m = Checkpoint(runs["dir"] / "jax3").manifest
    assert (m.framework, m.world_size, m.stage, m.step) == ("jax", 3, 2, 9)
    assert m.optimizer.name == "adam" and m.optimizer.hyperparameters["lr"] == 1e-2
    assert m.metadata["config"]["global_batch_size"] == 48
    t = Checkpoint(runs["dir"] / "torch2").manifest
    assert (t.framework, t.world_size, t.stage, t.step) == ("torch", 2, 1, SAVE)
    assert t.optimizer.hyperparameters["param_groups"][0]["betas"] == [0.9, 0.999]


# (resumed run, the run it continues, that run's step the resumed one started at, tolerances)
HAND_OVERS = {
    "torch 2 -> torch 3": ("torch3", "torch2", SAVE, SAME, SAME),
    "torch 3 -> torch 1": ("torch1", "torch3", 9, SAME, SAME),
    "torch -> JAX": ("jax3", "torch2", SAVE, PARITY_LOSS, PARITY_PARAMS),
    "JAX -> torch": ("torch2_from_jax", "jax3", 9, PARITY_LOSS, PARITY_PARAMS),
    "JAX 3 -> JAX 1": ("jax1", "jax3", 9, SAME, SAME),
}


@pytest.mark.parametrize("hand_over", list(HAND_OVERS))
def test_resumed_run_follows_the_uninterrupted_one(runs, hand_over):
    resumed, reference, start, loss_tol, params_tol = HAND_OVERS[hand_over]
    ref = runs[reference]
    np.testing.assert_allclose(runs[resumed].losses, ref.losses[start - ref.start_step:], **loss_tol)
    for k in ref.params:
        np.testing.assert_allclose(runs[resumed].params[k], ref.params[k], **params_tol, err_msg=k)


def test_resumed_runs_continue_the_curve(runs):
    # Not a restart: the first resumed loss is the uninterrupted run's loss at that step.
    assert runs["torch3"].start_step == SAVE and runs["jax1"].start_step == 9
    assert runs["torch3"].losses[0] < runs["torch2"].losses[0] * 0.9
