"""``bucket_cap_mb="auto"``: hybrid's DDP plans its buckets with :func:`hybrid.core.auto_plan`.

The first iteration (the one torch's DDP observes for its rebuild) also times each gradient's
hook (:class:`ReadyClock`). At the rebuild every rank takes part in the same steps: rank 0's ready
order (as for any rebuild), each gradient's ready time as the slowest rank saw it (a collective
cannot start before its last rank arrives), the process group's cost model
(:func:`hybrid.torch.measure_collectives`, cached per machine), what a pass over a gradient and a
bucket launch cost the backward's thread (measured, the slowest rank's), and how much of a
collective hides behind compute (:func:`_overlap`, from the cores; the least of the ranks').
Rank 0 plans, every rank receives its plan, and the fingerprints are compared as for any rebuild.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybrid.core import BucketPlan, CopyCost, TensorSpec, auto_plan, plan_buckets, predict_step, rebuild_plan
from hybrid.core.cost import PROBE_SIZES
from hybrid.torch._collectives import naming
from hybrid.torch._cost_probe import measure_collectives

AUTO = "auto"


class ReadyClock:
    """When each gradient of one backward became ready, net of the reducer's own work.

    The hook of gradient ``i`` calls :meth:`enter` before the reducer's work and :meth:`leave`
    after it. Gradient ``i`` was ready at its ``enter`` minus the time every earlier hook spent
    (which delayed the backward's thread, so it delayed ``i`` too): the backward's pure compute,
    what :func:`hybrid.core.auto_plan` expects. On CUDA the clock reads events on the current
    stream (the hooks run ahead of the kernels they follow), elsewhere ``time.perf_counter``.
    """

    def __init__(self, num_params: int, device: torch.device):
        self._cuda = device.type == "cuda"
        self._n = num_params
        self.reset()

    def reset(self) -> None:
        self._marks: list[tuple[int, object, object]] = []

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def enter(self):
        return self._now()

    def leave(self, index: int, entered) -> None:
        self._marks.append((index, entered, self._now()))

    def times(self) -> list[float]:
        """Seconds from the first gradient to each one (NaN for gradients no hook reported)."""
        if self._cuda and self._marks:
            torch.cuda.synchronize()
        out, own, first = [math.nan] * self._n, 0.0, None
        for index, entered, left in self._marks:
            first = entered if first is None else first
            if self._cuda:
                at, spent = first.elapsed_time(entered) / 1e3, entered.elapsed_time(left) / 1e3
            else:
                at, spent = entered - first, left - entered
            out[index] = at - own
            own += spent
        return out


def probe_sizes(total_bytes: int) -> tuple[int, ...]:
    """The sizes to measure for a model of ``total_bytes`` of gradients: PROBE_SIZES up to the
    first at or past the whole model (no bucket is bigger), at least two.

    >>> probe_sizes(400 << 10)
    (4096, 65536, 262144, 1048576)
    >>> probe_sizes(1 << 40) == PROBE_SIZES
    True
    """
    sizes = []
    for s in PROBE_SIZES:
        sizes.append(s)
        if s >= total_bytes and len(sizes) >= 2:
            break
    return tuple(sizes)


def _copy_cost(ranks, nbytes: int) -> CopyCost:
    """This rank's cost of one pass over a gradient (copied into a bucket with the scale, and back:
    two passes) and of launching a bucket (issuing an async all-reduce: every rank issues them).

    The copies are as big as the model's gradients (up to 32 MiB): a pass over data that fits the
    caches is several times cheaper per byte than over a model's worth (on this project's VMs
    27 ps/byte at 4 MiB, 70 at 16 MiB), and every rank copies at once, sharing the memory bus as
    the ranks' hooks do."""
    numel = max(1024, min(int(nbytes), 32 << 20) // 4)
    src = torch.randn(numel, device=ranks.device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if ranks.device.type == "cuda" else (lambda: None)
    passes = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        torch.mul(src, 1.0 / ranks.world, out=dst)
        src.copy_(dst)
        sync()
        passes.append(time.perf_counter() - t0)
    tiny = [torch.zeros(1, device=ranks.device) for _ in range(8)]
    launches = []
    for _ in range(3):
        t0 = time.perf_counter()
        futures = [dist.all_reduce(t, group=ranks.group, async_op=True).get_future() for t in tiny]
        launches.append((time.perf_counter() - t0) / len(tiny))
        for f in futures:
            f.wait()
    return CopyCost(statistics.median(passes[1:]) / (2 * numel * src.element_size()), statistics.median(launches))


def _overlap(ranks) -> float:
    """How much of a collective's time the backward does not feel, from what runs where.

    On a GPU, NCCL's kernels run beside the backward's on their own SMs: 1. On CPUs, gloo's
    threads need cores of their own: with the ranks on this host each running
    ``torch.get_num_threads()`` compute threads, what is left of this process's cores, per rank,
    is the share of a collective that runs beside the backward; a collective that finds no spare
    core takes turns with the compute (0). A model, not a measurement: timing compute against a
    collective on a busy machine gave anything from 0 to 1 for the same setting (issue 25's notes
    in docs/torch.md), while the arithmetic of cores matches what the steps show.
    """
    if ranks.device.type == "cuda":
        return 1.0
    hosts = [None] * ranks.world
    dist.all_gather_object(hosts, platform.node(), group=ranks.group)
    local = hosts.count(platform.node())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(1.0, max(0.0, (cores - local * torch.get_num_threads()) / local))


def _slowest(values: list[float], ranks) -> list[float]:
    """Each value's maximum over the ranks (NaN stays NaN only where every rank has NaN)."""
    t = torch.tensor([-1.0 if math.isnan(v) else v for v in values], dtype=torch.float64, device=ranks.device)
    if ranks.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ranks.group)
    return [math.nan if v < 0 else v for v in t.tolist()]


def plan_auto(ranks, specs: Sequence[TensorSpec], order: list[int], ready_s: list[float] | None, *,
              collectives: tuple, in_place: bool) -> tuple[BucketPlan, dict]:
    """The auto plan from rank 0's ready ``order`` and this rank's ready times ``ready_s`` (a
    collective: every rank of ``ranks``, a :class:`~hybrid.torch.ddp._sync.RankAgreement`, calls
    it), and the report of what it was planned from (``ddp._auto_report``).

    ``collectives``: what each bucket runs and what runs after the step (``("all_reduce", ())``
    for DDP's own all-reduce; ZeRO2 states its own); ``in_place``: whether a bucket may be its
    gradient itself (not with ``gradient_as_bucket_view`` or mixed precision)."""
    n = len(specs)
    order = list(order) + [i for i in reversed(range(n)) if i not in set(order)]  # unused ones last
    total = sum(s.nbytes for s in specs)
    kind, after = collectives
    kinds = sorted({kind, *(k for k, _ in after)})
    with naming("DistributedDataParallel (bucket_cap_mb='auto'): agreeing on ready times and costs"):
        seen = _slowest(ready_s or [math.nan] * n, ranks)
        copy = _copy_cost(ranks, total)
        # the slowest rank's costs; the least overlap (its 1 - overlap is the largest)
        per_byte, per_bucket, felt = _slowest([copy.seconds_per_byte, copy.seconds_per_bucket, 1 - _overlap(ranks)],
                                              ranks)
        # 9 rounds, not the probe's default 5: the plan weighs one size's median against another's,
        # and on a busy machine 5 rounds left a 16 MiB median a third above its 1 ns/byte neighbours
        model = measure_collectives(ranks.group, sizes=probe_sizes(total), kinds=kinds, reps=9)
    copy, overlap = CopyCost(per_byte, per_bucket), 1 - felt
    latest = max((t for t in seen if not math.isnan(t)), default=0.0)
    ready = [latest if math.isnan(seen[i]) else seen[i] for i in order]
    plan = None
    if ranks.rank == 0:
        plan = auto_plan(specs, order, ready, model, copy=copy, kind=kind, in_place=in_place, after_step=after,
                         overlap=overlap)
    if ranks.world > 1:
        box = [plan.dumps() if plan is not None else None]
        with naming("DistributedDataParallel (bucket_cap_mb='auto'): the broadcast of rank 0's plan"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(ranks.group, 0), group=ranks.group)
        plan = BucketPlan.from_json(box[0])
    default = rebuild_plan(plan_buckets(specs), order)
    report = {
        "cost_model": model.fingerprint(), "copy": copy, "overlap": overlap, "ready_order": order, "ready_s": ready,
        "predicted_exposed_s": {
            name: predict_step(p, order, ready, model, copy=copy, kind=kind, after_step=after, overlap=overlap).exposed_s
            for name, p in (("auto", plan), ("torch default caps", default))}}
    return plan, report
