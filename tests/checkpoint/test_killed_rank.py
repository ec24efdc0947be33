"""A rank killed in the middle of writing its file: the others raise within seconds (no hang),
the previous checkpoint stays intact and loadable, and no ``.ckpt.saving`` is left behind. Both distributed torch saves, on the demo's
model: DDP with ZeroRedundancyOptimizer (stage 1), and ZeRO3 with ZeRO3Optimizer (stage 3,
buckets capped at 4 KiB: each rank writes only its shards of them)."""

import datetime
import multiprocessing as mp
import os
import pathlib
import queue
import time

import pytest

from hybrid.checkpoint import Checkpoint
from tests._procs import free_port

TIMEOUT_S = 5


def _build(stage):
    """The demo's model and optimizer at ZeRO ``stage``, and ``train(start, stop)``, which runs those steps."""
    from hybrid.demo import TrainConfig, build_torch, train_torch_steps

    config = TrainConfig(num_steps=4, stage=stage, bucket_cap_bytes=None if stage == 1 else 4096)
    net, opt = build_torch(config)
    return net, opt, lambda start, stop: train_torch_steps(net, opt, config, start, stop)


def _worker(stage, rank, port, path, out):
    import torch
    import torch.distributed as dist

    import hybrid.checkpoint._protocol as protocol
    from hybrid.checkpoint import torch as ckpt_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(stage, r, port, path, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, outcome, seconds = out.get(timeout=120)
    except queue.Empty:
        pytest.fail("the surviving rank neither returned nor raised within 120 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
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
