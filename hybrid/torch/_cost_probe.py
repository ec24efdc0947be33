"""Measure the collectives of a torch process group into a :class:`hybrid.core.CostModel`.

Every rank runs the same collectives at the same sizes, alone and in back-to-back trains (what
DDP's buckets are); each round's slowest rank counts (a collective ends when its last rank does)
and every rank fits the same medians, so every rank plans alike. The model
is cached per machine (``$HYBRID_CACHE_DIR``, default ``~/.cache/hybrid``) under what it holds
for: backend, world size, the hosts, torch's version and the sizes measured.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.core import CostModel
from hybrid.core.cost._collectives import COLLECTIVES, PROBE_SIZES
from hybrid.core._fingerprint import fingerprint_of
from hybrid.torch._collectives import all_gather_into, naming, reduce_scatter_into


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_CACHE_DIR", Path.home() / ".cache" / "hybrid"))


def _run(kind: str, buf: torch.Tensor, part: torch.Tensor, group, async_op: bool = False):
    if kind == "all_reduce":
        return dist.all_reduce(buf, group=group, async_op=async_op)
    if kind == "reduce_scatter":
        return reduce_scatter_into(part, buf, group=group, async_op=async_op)
    if kind == "all_gather":
        return all_gather_into(buf, part, group=group, async_op=async_op)
    return dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                          async_op=async_op)


def train_length(nbytes: int) -> int:
    """How many collectives of ``nbytes`` a train holds: 32 for small messages, down to 4 from
    1 MiB on.

    A short train does not show what a long one costs. Small messages come in long trains (every
    gradient its own bucket: hundreds): on gloo at 2 ranks on 2 cores, 4 KiB all-reduces add
    0.27-0.34 ms each to a train of 8 and 0.5-0.65 ms from 24 on (the isolated time is 0.43 ms),
    so the model fitted from trains of 8 put a 200-tensor step at half its time. Big ones come in
    trains of 2-5 (buckets at torch's caps, or a model's weights each alone), and the second of a
    train overlaps the first more than later ones overlap theirs (gloo runs two at a time): 16
    MiB all-reduces, 2 ranks on 2 cores, add 8.9 ms to a train of 2 and 11.6 ms each to one of 4
    (14.1 alone); 3 ranks, 13.8 and 17.5 (23.9 alone); medians of 15, 2026-11-26 (docs/core.md).

    >>> train_length(4096), train_length(1 << 20), train_length(32 << 20)
    (32, 4, 4)
    """
    return max(4, min(32, -(-(4 << 20) // max(int(nbytes), 1))))


def repeats(nbytes: int) -> int:
    """How often a round times a collective of ``nbytes``: 8 times up to 128 KiB, once from 1 MiB.

    A small collective takes a fraction of a millisecond, the size of a scheduler's hiccup on a
    busy machine (with more ranks than cores, one waits out another's time slice, ~4 ms): timing
    it several times per round puts more samples behind its median at little cost.

    >>> repeats(4096), repeats(256 << 10), repeats(32 << 20)
    (8, 4, 1)
    """
    return max(1, min(8, (1 << 20) // max(int(nbytes), 1)))


# From this size on, a round also times mixed trains (each collective behind a smallest-size one).
MIXED_FROM = 1 << 20


class Prober:
    """The buffers and the timing of one rank's probe: every rank of ``group`` builds one with the
    same ``kinds`` and ``sizes`` and calls :meth:`round` together (each call is collective).

    A round times, per collective and size, :func:`repeats` isolated collectives (a barrier
    before each, so all ranks start together) and as many trains of :func:`train_length` of them
    issued back to back and waited on together, as DDP issues its buckets. From
    :data:`MIXED_FROM` bytes on it also times as many *mixed* trains: the same collectives with
    one of the smallest size between each two, as a train of one bucket per tensor alternates
    weights and biases (a big collective hides less of itself behind a small one: see
    :func:`hybrid.core.cost.stream_ends`). Tests interleave rounds with the workload they predict.
    """

    def __init__(self, group, kinds, sizes, device):
        self.group, self.device = group, device
        world = dist.get_world_size(group)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for kind in kinds:
            if kind not in COLLECTIVES:
                raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
        # One train of buffers per size, shared by the collectives (their values do not matter),
        # each buffer in one collective at a time (a buffer reused within a train ran faster).
        trains = {}
        for nbytes in sizes:
            numel = max(world, int(nbytes) // 4 // world * world)  # a multiple of the world: equal shards
            trains[numel * 4] = [(torch.zeros(numel, device=device), torch.zeros(numel // world, device=device))
                                 for _ in range(train_length(numel * 4))]
        smallest = min(trains)
        self.cases = []  # (kind, nbytes, [(buffer, shard)] of a train, the mixed train's or None)
        for kind in kinds:
            for nbytes, train in trains.items():
                mixed = None
                if nbytes >= MIXED_FROM and nbytes > smallest:
                    # big, small, big, ..., big: every big one after the first follows a small one
                    mixed = [c for pair in zip(train[:-1], trains[smallest]) for c in pair] + train[-1:]
                self.cases.append((kind, nbytes, train, mixed))

    def _timed(self, kind, train) -> float:
        dist.barrier(group=self.group)
        self.sync()
        t0 = time.perf_counter()
        works = [_run(kind, buf, part, self.group, async_op=True) for buf, part in train]
        for w in works:
            w.wait()
        self.sync()
        return time.perf_counter() - t0

    def round(self) -> list[float]:
        """This rank's times of one round: per case, its isolated collectives, its trains, then its
        mixed trains (where it has them)."""
        times = []
        for kind, nbytes, train, mixed in self.cases:
            n = repeats(nbytes)
            times += [self._timed(kind, train[:1]) for _ in range(n)]
            times += [self._timed(kind, train) for _ in range(n)]
            if mixed:
                times += [self._timed(kind, mixed) for _ in range(n)]
        return times

    def slowest(self, seconds: list[float]) -> list[float]:
        """Each time, the slowest rank's (a collective ends when its last rank does)."""
        t = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def samples(self, rounds: list[list[float]]) -> dict:
        """The keyword arguments of :meth:`hybrid.core.CostModel.fit` (``samples``, ``trains``,
        ``mixed``) from rounds of times."""
        samples, trains, mixed = [], [], []
        for times in rounds:
            it = iter(times)
            for kind, nbytes, train, mixed_train in self.cases:
                n = repeats(nbytes)
                samples += [(kind, nbytes, next(it)) for _ in range(n)]
                trains += [(kind, nbytes, len(train), next(it)) for _ in range(n)]
                if mixed_train:
                    mixed += [(kind, nbytes, len(train), next(it)) for _ in range(n)]
        return {"samples": samples, "trains": trains, "mixed": mixed}


def measure_collectives(process_group=None, *, sizes=PROBE_SIZES, reps: int = 5, cache: bool = True,
                        kinds=COLLECTIVES) -> CostModel:
    """The cost model of ``process_group`` (default: the world), measured or from the cache.

    Call it on every rank of the group, like a collective. Each collective in ``kinds`` is timed
    at every size, alone and in back-to-back trains (:class:`Prober`), ``reps`` rounds after a
    warm-up; the slowest rank's time of each counts. With ``cache=True`` a model measured before
    on the same hosts, backend, world size, torch version, kinds and sizes is read back instead.

    Example (2 gloo ranks; see tests/torch/test_cost_model.py)::

        model = hybrid.torch.measure_collectives()
        model.seconds("all_reduce", 4 << 20)   # predicted seconds of a 4 MiB all-reduce
        model.gap("all_reduce", 4 << 20)       # what one more adds to a back-to-back train
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
             "sizes": sorted(int(s) for s in sizes), "reps": reps, "kinds": sorted(kinds),
             "probe": "isolated+trains+mixed"}
    path = cache_dir() / f"cost-torch-{fingerprint_of(about)}.json"
    found = [None]
    if rank == 0 and cache and path.is_file():
        found[0] = path.read_text()
    dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if found[0] is not None:
        return CostModel.from_json(found[0])
    with naming("hybrid.torch.measure_collectives"):
        prober = Prober(group, kinds, sizes, device)
        prober.round()  # warm-up: connections, allocations
        rounds = [prober.slowest(prober.round()) for _ in range(reps)]
    model = CostModel.fit(**prober.samples(rounds), world_size=world, about=about)
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
