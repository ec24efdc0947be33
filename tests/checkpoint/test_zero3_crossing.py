"""A stage-3 checkpoint crosses frameworks: JAX stage 3 resumes in torch ZeRO3 and ZeRO-1, torch
ZeRO3 in JAX stages 3, 2 and 1, each at another world size and bucket plan than the saver's.

The twin MLP of hybrid.demo (``TrainConfig(stage=3)``: torch ``ZeRO3`` + ``ZeRO3Optimizer``, JAX
``zero(stage=3)`` over ``shard_params``). The two savers hold different plans (JAX: 2 buckets at a
2 KiB cap, cut for 3 devices; torch: ZeRO3's default plan, one bucket, cut for 2 ranks) and
every resumer holds a plan of its own: the load relays through the plan the manifest carries.
A resumed run must follow the saving framework's uninterrupted run within the parity tolerance
(``hybrid.parity.Tolerance()``: losses rtol 1e-5 / atol 1e-6 per step, parameters rtol 1e-4 /
atol 1e-5, as tests/parity: torch's and XLA's float32 kernels round differently). Each resumed
run saves again before its first step: loading moves elements and computes nothing, so those
files hold the saved tensors bit for bit.

Same-framework crossings are in test_zero3.py (torch) and test_zero3_checkpoint.py (JAX), JAX
stage 3 into torch ZeRO2 in test_zero3_checkpoint.py::test_resumes_in_torch.
"""

import traceback

import numpy as np
import pytest

from hybrid.checkpoint import Checkpoint
from hybrid.demo import TrainConfig, train_jax
from hybrid.parity import Tolerance
from tests._procs import forkserver_ranks, init_gloo

SAVE, STEPS = 4, 8
CONFIG = dict(global_batch_size=48, num_steps=STEPS)  # 48 rows split evenly over 1 to 4 ranks
TOL = Tolerance()


def _torch_rank(config, world, run, rank, port, out):
    """One rank of ``hybrid.demo.train_torch(config, **run)``; reports the result or the traceback."""
    import torch.distributed as dist

    from hybrid.demo import pin_torch_numerics, train_torch

    try:
        init_gloo(rank, port, world=world)
        pin_torch_numerics()
        out.put((rank, train_torch(config, **run), 0.0))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, traceback.format_exc(), 0.0))


def _torch(config, world, **run):
    reports, _ = forkserver_ranks(_torch_rank, (config, world, run), world, world=world, wait_s=120)
    for rank, (result, _) in sorted(reports.items()):
        if isinstance(result, str):
            pytest.fail(f"torch rank {rank} of {world} failed:\n{result}")
    return reports[0][0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero3_crossing")
    jax3 = TrainConfig(**CONFIG, stage=3, bucket_cap_bytes=2048)
    torch3 = TrainConfig(**CONFIG, stage=3)
    out = {"dir": d}
    # The savers: uninterrupted runs, saving after step SAVE.
    out["jax3 x3"] = train_jax(jax3, num_devices=3, save_to=str(d / "jax3"), save_at=SAVE)
    out["torch3 x2"] = _torch(torch3, 2, save_to=str(d / "torch3"), save_at=SAVE)
    # JAX stage 3 -> torch: ZeRO3 on 2 ranks (its default plan), ZeRO-1 on 1.
    out["torch3 x2 <- jax3"] = _torch(torch3, 2, resume=str(d / "jax3"), save_to=str(d / "copy torch3"),
                                      save_at=SAVE)
    out["torch1 x1 <- jax3"] = _torch(TrainConfig(**CONFIG, stage=1), 1, resume=str(d / "jax3"))
    # torch ZeRO3 -> JAX: stage 3 on 3 devices (2 buckets), stage 2 on 4, stage 1 on 1.
    out["jax3 x3 <- torch3"] = train_jax(jax3, num_devices=3, resume=str(d / "torch3"),
                                         save_to=str(d / "copy jax3"), save_at=SAVE)
    out["jax2 x4 <- torch3"] = train_jax(TrainConfig(**CONFIG, stage=2), num_devices=4, resume=str(d / "torch3"))
    out["jax1 x1 <- torch3"] = train_jax(TrainConfig(**CONFIG, stage=1), num_devices=1, resume=str(d / "torch3"))
    return out


def test_the_savers_hold_different_plans(runs):
    jax_saved, torch_saved = Checkpoint(runs["dir"] / "jax3").manifest, Checkpoint(runs["dir"] / "torch3").manifest
    assert (jax_saved.framework, jax_saved.stage, jax_saved.world_size, jax_saved.step) == ("jax", 3, 3, SAVE)
    assert (torch_saved.framework, torch_saved.stage, torch_saved.world_size, torch_saved.step) == ("torch", 3, 2, SAVE)
    assert jax_saved.plan != torch_saved.plan and jax_saved.plan.num_buckets == 2  # zero3_plan at a 2 KiB cap: a layer per bucket


@pytest.mark.parametrize("resumed, saver", [("torch3 x2 <- jax3", "jax3 x3"), ("torch1 x1 <- jax3", "jax3 x3"),
                                            ("jax3 x3 <- torch3", "torch3 x2"), ("jax2 x4 <- torch3", "torch3 x2"),
                                            ("jax1 x1 <- torch3", "torch3 x2")])
def test_resumed_run_follows_the_uninterrupted_one(runs, resumed, saver):
    got, want = runs[resumed], runs[saver]
    assert got.start_step == SAVE and len(got.losses) == STEPS - SAVE
    np.testing.assert_allclose(got.losses, want.losses[SAVE:], rtol=TOL.loss_rtol, atol=TOL.loss_atol)
    assert list(got.params) == list(want.params)
    for name, value in want.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=TOL.param_rtol, atol=TOL.param_atol, err_msg=name)


@pytest.mark.parametrize("copy, source", [("copy torch3", "jax3"), ("copy jax3", "torch3")])
def test_load_then_save_is_bitwise(runs, copy, source):
    src, dst = Checkpoint(runs["dir"] / source), Checkpoint(runs["dir"] / copy)
    assert dst.manifest.stage == 3 and dst.manifest.framework != src.manifest.framework
    assert dst.manifest.step == SAVE and dst.manifest.optimizer.count == src.manifest.optimizer.count == SAVE
    for kind in ("params", "mu", "nu"):
        a, b = src.tensors(kind), dst.tensors(kind)
        assert sorted(a) == sorted(b), kind
        for name in a:
            assert np.array_equal(a[name], b[name]), (kind, name)
