"""Measure the collectives of a torch process group into a :class:`hybrid.core.CostModel`.

Every rank runs the same collectives at the same sizes; each time is the median of a few
repetitions, the slowest rank's median counts (a collective ends when its last rank does), and
rank 0 fits the lines and hands the same model to everyone, so every rank plans alike. The model
is cached per machine (``$HYBRID_CACHE_DIR``, default ``~/.cache/hybrid``) under what it holds
for: backend, world size, the hosts, torch's version and the sizes measured.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.core import CostModel
from hybrid.core.cost._collectives import PROBE_SIZES
from hybrid.core._fingerprint import fingerprint_of
from hybrid.torch._collectives import all_gather_into, naming, reduce_scatter_into


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_CACHE_DIR", Path.home() / ".cache" / "hybrid"))


def _run(kind: str, buf: torch.Tensor, part: torch.Tensor, group) -> None:
    if kind == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif kind == "reduce_scatter":
        reduce_scatter_into(part, buf, group=group)
    elif kind == "all_gather":
        all_gather_into(buf, part, group=group)
    else:
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)


def _time_collectives(sizes, reps: int, group, device) -> list[tuple[str, int, float]]:
    world = dist.get_world_size(group)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)  # a multiple of the world: equal shards
            buf = torch.zeros(numel, device=device)
            part = torch.zeros(numel // world, device=device)
            times = []
            for rep in range(reps + 1):  # the first is a warm-up (connections, allocations)
                dist.barrier(group=group)
                sync()
                t0 = time.perf_counter()
                _run(kind, buf, part, group)
                sync()
                if rep:
                    times.append(time.perf_counter() - t0)
            rows.append((kind, numel * 4, statistics.median(times)))
    return rows


def measure_collectives(process_group=None, *, sizes=PROBE_SIZES, reps: int = 5, cache: bool = True) -> CostModel:
    """The cost model of ``process_group`` (default: the world), measured or from the cache.

    Call it on every rank of the group, like a collective. With ``cache=True`` a model measured
    before on the same hosts, backend, world size, torch version and sizes is read back instead.

    Example (2 gloo ranks; see tests/torch/test_cost_model.py)::

        model = hybrid.torch.measure_collectives()
        model.seconds("all_reduce", 4 << 20)   # predicted seconds of a 4 MiB all-reduce
    """
    if reps < 1 or not sizes or min(sizes) <= 0:
        raise ValueError(f"measure_collectives needs reps >= 1 and positive sizes, got reps={reps}, sizes={sizes}")
    group = process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    hosts = [None] * world
    dist.all_gather_object(hosts, platform.node(), group=group)
    about = {"backend": backend, "world_size": world, "hosts": sorted(set(hosts)), "torch": torch.__version__,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
             "sizes": sorted(int(s) for s in sizes), "reps": reps}
    path = cache_dir() / f"cost-torch-{fingerprint_of(about)}.json"
    found = [None]
    if rank == 0 and cache and path.is_file():
        found[0] = path.read_text()
    dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if found[0] is not None:
        return CostModel.from_json(found[0])
    with naming("hybrid.torch.measure_collectives"):
        rows = _time_collectives(sizes, reps, group, device)
        slowest = torch.tensor([t for _, _, t in rows], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    rows = [(k, n, float(t)) for (k, n, _), t in zip(rows, slowest.tolist())]
    model = CostModel.fit(rows, world_size=world, about=about)
    if rank == 0 and cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(model.to_json(), indent=1))
        os.replace(tmp, path)  # a reader sees the old file or the whole new one
    return model


def _local_rank(rank: int, world_size: int, port: int, out) -> None:
    import datetime
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = measure_collectives()
        if rank == 0:
            out.put(json.dumps(model.to_json()))
    finally:
        dist.destroy_process_group()


def measure_local(world_size: int = 2) -> CostModel:
    """Measure (or read from the cache) a gloo group of ``world_size`` processes on this machine:
    what ``python -m hybrid plan --project --cost measure`` projects from."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_local_rank, args=(world_size, port, out), nprocs=world_size, join=True, start_method="spawn")
    return CostModel.from_json(out.get())
