"""The demo's torch runs on gloo ranks forked from the test run's preloaded forkserver.

``hybrid.demo.launch_torch`` / ``spawn_world`` start every rank as a fresh interpreter that imports
torch (2-3 s of CPU per rank on these cores, most of a small run); the ranks here are forked from
the forkserver of tests/_procs.py, which imported torch once for the whole test run. Each rank
runs what ``spawn_world``'s rank runs: gloo on 127.0.0.1, ``pin_torch_numerics()``, then
``fn(*args, **kwargs, progress=None)``. The checkpoint tests that use it check the world size a
checkpoint is saved at or loaded into, so each run still gets a world of its own size.

``fn`` travels by reference: a rank imports its module, so a module handing its own function
should not import jax at its top (the ranks would each import it).
"""

import traceback

import pytest

from tests._procs import forkserver_ranks, init_gloo

COLLECTIVE_TIMEOUT_S = 60  # as hybrid.demo's worlds: a rank that dies fails the others within this


def _rank(fn, args, kwargs, world_size, rank, port, out):
    """One rank: ``fn``'s value (rank 0's; the others report None) or the traceback."""
    import torch.distributed as dist

    from hybrid.demo import pin_torch_numerics

    try:
        init_gloo(rank, port, world=world_size, timeout_s=COLLECTIVE_TIMEOUT_S)
        pin_torch_numerics()
        value = fn(*args, **kwargs, progress=None)
        out.put((rank, ("value", value if rank == 0 else None), 0.0))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, ("error", traceback.format_exc()), 0.0))


def torch_world(fn, *args, world_size: int = 2, wait_s: float = 150, **kwargs):
    """``fn(*args, **kwargs, progress=None)`` on each rank of a gloo world of ``world_size`` forked
    ranks; rank 0's value, as ``hybrid.demo.spawn_world`` returns it. A rank that raises fails the
    test with its traceback.

    >>> from hybrid.demo import TrainConfig, train_torch
    >>> torch_world(train_torch, TrainConfig(num_steps=3), world_size=1).losses.shape
    (3,)
    """
    reports, _ = forkserver_ranks(_rank, (fn, args, kwargs, world_size), world_size, world=world_size, wait_s=wait_s)
    for rank, ((kind, value), _) in sorted(reports.items()):
        if kind == "error":
            pytest.fail(f"torch rank {rank} of {world_size} failed:\n{value}")
    return reports[0][0][1]
