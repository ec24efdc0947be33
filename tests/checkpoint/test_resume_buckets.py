"""``hybrid.checkpoint.torch.load(..., restore_buckets=True)``: a resume at 4 gloo ranks that equals
the uninterrupted run bit for bit.

The default resume (torch's behaviour, kept) builds a fresh DDP, which reduces its first step in
one bucket per dtype and rebuilds at its second; a ring all-reduce sums an element in an order
that depends on where it lies in its bucket, so from 3 ranks on that first step rounds differently
from the uninterrupted run's (the issue measured 1.2e-7, 4.4e-5 on an attention key bias, after
a GPT's resume at 4 processes; torch's own classes do the same). Restoring the saving DDP's
rebuilt plan makes the first resumed step reduce in the same buckets. Oracle: the uninterrupted
run in the same world; tolerance: none (bit for bit).

A load followed at once by a save gives back the same bytes (docs/moving-runs.md), with either
load: the fresh DDP has not rebuilt yet, and carries the checkpoint's record of the rebuilt plan
into its save until it rebuilds its own.

The 4-rank world is started once for the file (every run above in it, the ranks forked from the
test run's preloaded forkserver: ``tests._procs.torch_world``); the other tests need one rank, this process.
"""

import contextlib
import dataclasses
import os
import pathlib

import numpy as np
import pytest

from hybrid.demo import TrainConfig
from hybrid.models import GPTConfig
from tests._procs import torch_world

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
# Buckets capped at 16 KiB (bucket_cap_mb given: torch caps the first bucket alike), so the rebuilt
# plan holds several buckets and the first resumed step's single bucket lays the elements out
# differently; the demo's GPT pair with its attention, ZeRO-1 (DDP + ZeroRedundancyOptimizer), Adam.
CONFIG = TrainConfig(num_steps=6, gpt=GPT, seq_len=16, global_batch_size=8, bucket_cap_bytes=16 << 10, lr=1e-2)
SAVE_AT = 3


def _final(ddp) -> dict:
    return {n: p.detach().clone().numpy() for n, p in ddp.module.named_parameters()}


def _resumes(config, path, save_at, *, progress=None):
    """On every rank: the uninterrupted run (saving after ``save_at``), then two resumes from that
    checkpoint with a fresh DDP and optimizer, as a relaunched job builds them: torch's default,
    and with the saved buckets restored; each saves at once (``PATH.resaved.False`` / ``.True``)
    before it trains on. Then a third resume, from the default load's resave, with the buckets
    restored: the record went through that save. Last, ZeRO2 (on the DDP) and ZeRO3 runs saved
    at ``save_at`` (``PATH.stageN``) and resaved at once by a fresh run (``PATH.stageN.resaved``)."""
    from hybrid.checkpoint import torch as checkpoint
    from hybrid.demo import build_torch, initial_params, train_torch_steps

    start = initial_params(config)
    ddp, opt = build_torch(config, start)
    train_torch_steps(ddp, opt, config, 0, save_at)
    checkpoint.save(path, ddp, opt, step=save_at)
    train_torch_steps(ddp, opt, config, save_at, config.num_steps)
    out = {"uninterrupted": _final(ddp), "saved_buckets": ddp.bucket_plan.num_buckets,
           "saved_order": [ddp.bucket_plan.specs[m].name for b in ddp.bucket_plan.buckets for m in b.members]}
    for restore in (False, True):
        ddp, opt = build_torch(config, start)
        checkpoint.load(path, ddp, opt, restore_buckets=restore)
        out[f"first_step_buckets/{restore}"] = ddp.bucket_plan.num_buckets
        checkpoint.save(f"{path}.resaved.{restore}", ddp, opt, step=save_at)
        train_torch_steps(ddp, opt, config, save_at, config.num_steps)
        out[f"resumed/{restore}"] = _final(ddp)
    ddp, opt = build_torch(config, start)
    checkpoint.load(f"{path}.resaved.False", ddp, opt, restore_buckets=True)
    train_torch_steps(ddp, opt, config, save_at, config.num_steps)
    out["resumed/from the resave"] = _final(ddp)
    for stage in (2, 3):
        staged = dataclasses.replace(config, stage=stage)
        model, opt = build_torch(staged, start)
        train_torch_steps(model, opt, staged, 0, save_at)
        checkpoint.save(f"{path}.stage{stage}", model, opt, step=save_at)
        model, opt = build_torch(staged, start)
        checkpoint.load(f"{path}.stage{stage}", model, opt)
        checkpoint.save(f"{path}.stage{stage}.resaved", model, opt, step=save_at)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "ckpt"
    return torch_world(_resumes, CONFIG, str(path), SAVE_AT, world_size=4, wait_s=170), path


def test_restored_buckets_resume_bit_for_bit_at_four_ranks(four_ranks):
    out, _ = four_ranks
    assert out["saved_buckets"] > 1 and out["first_step_buckets/True"] == out["saved_buckets"]
    assert out["first_step_buckets/False"] == 1  # torch's: the first step in one bucket per dtype
    for name, want in out["uninterrupted"].items():
        np.testing.assert_array_equal(out["resumed/True"][name], want, err_msg=name)
    diffs = {n: float(np.abs(out["resumed/False"][n] - w).max()) for n, w in out["uninterrupted"].items()}
    worst = max(diffs, key=diffs.get)
    print(f"\nat 4 ranks, the default resume ends {diffs[worst]:.2e} off the uninterrupted run ({worst}); "
          f"with restore_buckets=True 0 (bit for bit)")


def test_a_load_then_a_save_gives_back_the_same_bytes(four_ranks):
    """An outside user's check of docs/moving-runs.md (DDP + ZeRO-1, trained, saved; a fresh run
    loads and saves at once): every file, manifest included, byte for byte the loaded one's, with
    torch's default load and with restore_buckets=True; and the copy still resumes the run bit for
    bit (its record of the rebuilt plan, which the fresh DDP had not made yet, went through)."""
    out, path = four_ranks
    for restore in (False, True):
        assert _files(pathlib.Path(f"{path}.resaved.{restore}")) == _files(path), f"restore_buckets={restore}"
    for name, want in out["uninterrupted"].items():
        np.testing.assert_array_equal(out["resumed/from the resave"][name], want, err_msg=name)


def test_zero2_and_zero3_runs_load_then_save_the_same_bytes(four_ranks):
    """The same claim for ZeRO2 (its DDP drops the record as ZeRO-1's did) and ZeRO3 (no DDP)."""
    _, path = four_ranks
    for stage in (2, 3):
        saved = pathlib.Path(f"{path}.stage{stage}")
        assert _files(pathlib.Path(f"{saved}.resaved")) == _files(saved), f"stage {stage}"
    from hybrid.checkpoint import Checkpoint
    assert "ddp_buckets" in Checkpoint(f"{path}.stage2").manifest.run_state  # the record ZeRO2's resave carried


def test_the_checkpoint_tells_a_jax_run_torchs_own_ready_order(four_ranks):
    """With no torch module at hand, the checkpoint a DDP saved says torch's order: its rebuilt
    plan's members, the order the torch run observed."""
    from hybrid.checkpoint import torch_ready_order
    out, path = four_ranks
    assert list(torch_ready_order(path)) == out["saved_order"]
    assert out["saved_order"][:2] == ["ln_f.weight", "ln_f.bias"]  # a norm: weight first, as torch's backward


def test_restore_buckets_is_refused_where_it_cannot_apply(tmp_path):
    """Before anything changes: a checkpoint with no DDP plan (saved from a plain module), and a
    module that is no hybrid DDP."""
    import torch

    from hybrid.checkpoint import CheckpointError
    from hybrid.checkpoint import torch as checkpoint

    model = torch.nn.Linear(3, 2)
    checkpoint.save(tmp_path / "plain", model, step=1)
    with pytest.raises(TypeError, match="restores hybrid.torch.DistributedDataParallel's buckets; got a Linear"):
        checkpoint.load(tmp_path / "plain", torch.nn.Linear(3, 2), restore_buckets=True)
    from hybrid.torch import DistributedDataParallel
    with _one_rank():
        ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
        before = ddp.module.weight.detach().clone()
        with pytest.raises(CheckpointError, match="records no rebuilt DDP bucket plan"):
            checkpoint.load(tmp_path / "plain", ddp, restore_buckets=True)
        assert torch.equal(ddp.module.weight, before)  # nothing loaded
        ddp(torch.ones(2, 3)).sum().backward()
        ddp(torch.ones(2, 3)).sum().backward()  # rebuilt at its second forward
        checkpoint.save(tmp_path / "ddp", ddp, step=2)
        other = DistributedDataParallel(torch.nn.Linear(3, 2), bucket_cap_mb=1)
        with pytest.raises(CheckpointError, match=r"saved from a DDP with bucket_cap_mb=None, this one has 1"):
            checkpoint.load(tmp_path / "ddp", other, restore_buckets=True)
        same = DistributedDataParallel(torch.nn.Linear(3, 2))
        checkpoint.load(tmp_path / "ddp", same, restore_buckets=True)
        assert same.bucket_plan == ddp.bucket_plan and same._has_rebuilt


@contextlib.contextmanager
def _one_rank():
    """A gloo world of this process alone (a DDP needs a process group; nothing is sent)."""
    import datetime

    import torch.distributed as dist

    from hybrid.demo._world import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _files(path: pathlib.Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_a_loaded_run_carries_the_record_until_it_has_a_newer_one(tmp_path):
    """The checkpoint's record of the rebuilt DDP plan goes into the saves of the module it was
    loaded into (same bytes) until that DDP rebuilds (then its own plan: here another cap, so the
    two differ), or for another module (a plain one) until its next load (a checkpoint with no
    record: then none)."""
    import torch

    from hybrid.checkpoint import Checkpoint
    from hybrid.checkpoint import torch as checkpoint
    from hybrid.torch import DistributedDataParallel

    def steps(ddp, n):
        for _ in range(n):
            ddp(torch.ones(2, 3)).sum().backward()

    with _one_rank():
        torch.manual_seed(0)
        saving = DistributedDataParallel(torch.nn.Linear(3, 2))
        steps(saving, 2)  # rebuilt at its second forward
        checkpoint.save(tmp_path / "saved", saving, step=2)
        record = Checkpoint(tmp_path / "saved").manifest.run_state["ddp_buckets"]
        assert record["settings"]["bucket_cap_mb"] is None

        fresh = DistributedDataParallel(torch.nn.Linear(3, 2), bucket_cap_mb=1)
        checkpoint.load(tmp_path / "saved", fresh)
        checkpoint.save(tmp_path / "resaved", fresh, step=2)
        assert _files(tmp_path / "resaved") == _files(tmp_path / "saved")
        steps(fresh, 1)  # one step: not rebuilt yet, still the loaded record
        checkpoint.save(tmp_path / "stepped", fresh, step=3)
        assert Checkpoint(tmp_path / "stepped").manifest.run_state["ddp_buckets"] == record
        steps(fresh, 1)  # its rebuild: its own plan, made with its own cap, from here on
        checkpoint.save(tmp_path / "rebuilt", fresh, step=4)
        assert Checkpoint(tmp_path / "rebuilt").manifest.run_state["ddp_buckets"]["settings"]["bucket_cap_mb"] == 1

        plain = torch.nn.Linear(3, 2)
        checkpoint.load(tmp_path / "saved", plain)
        checkpoint.save(tmp_path / "plain_resaved", plain, step=2)
        assert _files(tmp_path / "plain_resaved") == _files(tmp_path / "saved")
        checkpoint.save(tmp_path / "no_record", torch.nn.Linear(3, 2), step=0)
        checkpoint.load(tmp_path / "no_record", plain)
        checkpoint.save(tmp_path / "plain_again", plain, step=0)
        assert "ddp_buckets" not in Checkpoint(tmp_path / "plain_again").manifest.run_state
