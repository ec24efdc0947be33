"""A rank killed in the middle of writing its file: the others raise within seconds (no hang),
the previous checkpoint stays intact and loadable, and no ``.ckpt.saving`` is left behind. Both distributed torch saves, on the demo's
model: DDP with ZeroRedundancyOptimizer (stage 1), and ZeRO3 with ZeRO3Optimizer (stage 3,
buckets capped at 4 KiB: each rank writes only its shards of them).

Each case starts a 2-rank world of its own, since a rank of it is killed; the ranks are forked
from the test run's preloaded forkserver (tests/_procs.py), not fresh interpreters importing torch.
"""

import os
import pathlib
import time

import pytest

from hybrid.checkpoint import Checkpoint
from tests._procs import forkserver_ranks, init_gloo

TIMEOUT_S = 5


def _build(stage):
    """The demo's model and optimizer at ZeRO ``stage``, and ``train(start, stop)``, which runs those steps."""
    from hybrid.demo import TrainConfig, build_torch, train_torch_steps

    config = TrainConfig(num_steps=4, stage=stage, bucket_cap_bytes=None if stage == 1 else 4096)
    net, opt = build_torch(config)
    return net, opt, lambda start, stop: train_torch_steps(net, opt, config, start, stop)


def _worker(stage, path, rank, port, out):
    import hybrid.checkpoint._protocol as protocol
    from hybrid.checkpoint import torch as ckpt_torch

    init_gloo(rank, port, timeout_s=TIMEOUT_S)
    ddp, opt, train = _build(stage)
    train(0, 2)
    ckpt_torch.save(path, ddp, opt, step=2)
    train(2, 4)
    if rank == 1:
        class HalfThenDie(protocol.FileSystem):
            def before(self, op, path):
                if op == "write" and path.name.startswith("rank-"):
                    os._exit(17)  # killed mid-write (the first chunk is on disk): no exception, no cleanup

        protocol.fs = HalfThenDie()
    t0 = time.monotonic()
    try:
        ckpt_torch.save(path, ddp, opt, step=4)
        out.put((rank, "returned", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - what the survivor raises is the test's subject
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


@pytest.mark.parametrize("stage", [1, 3])
def test_killed_rank_leaves_previous_checkpoint(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    reports, procs = forkserver_ranks(_worker, (stage, path), 1, wait_s=120)  # the survivor's report
    (rank, (outcome, seconds)), = reports.items()
    assert procs[1].exitcode == 17
    print(f"rank 0 raised after {seconds:.2f} s: {outcome[:200]}")
    assert rank == 0 and outcome.startswith("RuntimeError: saving checkpoint"), outcome
    assert "failed in the all_gather_object of file checksums" in outcome and "untouched" in outcome
    assert seconds < 2 * TIMEOUT_S, f"the survivor took {seconds:.1f} s to raise: {outcome}"
    ckpt = Checkpoint(path)
    ckpt.verify()
    assert ckpt.manifest.step == 2 and ckpt.manifest.stage == stage
    assert pathlib.Path(path, "manifest.json").exists()
    # rank 0 began the save and lives: it removed what was staged, the dead rank's half file included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
