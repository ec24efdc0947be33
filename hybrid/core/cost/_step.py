"""A training step's communication under DDP and ZeRO stages 1-3, on a plan and a cost model:
bytes each rank sends, time on the wire, and the part the compute does not hide.

The step is simulated as two streams (hybrid.core.cost._collectives.exposed_seconds): compute, cut per bucket
in proportion to the bucket's elements (a dense layer's FLOPs are proportional to its
parameters), and one communication stream that runs collectives in issue order:

- DDP: bucket ``b``'s all-reduce starts once its backward slice is done (plan order is the
  gradient-ready order); the step ends when the last all-reduce does.
- ZeRO-1 (torch's ZeroRedundancyOptimizer over DDP): as DDP, then every rank broadcasts its
  updated share (1/p of the parameters), after the backward.
- ZeRO-2: a reduce-scatter per bucket in place of the all-reduce, then an all-gather of every
  bucket's updated parameters.
- ZeRO-3: each bucket's parameters all-gathered before its forward slice (buckets in
  hybrid.core.forward_order) and again before its backward slice (``prefetch`` buckets gathered
  ahead: hybrid.core.gather_windows), gradients reduce-scattered after it: 1.5x DDP's bytes (the
  ZeRO paper's figure).

>>> from hybrid.core import TensorSpec, plan_buckets
>>> from hybrid.core.cost._collectives import NETWORKS, collective_seconds
>>> plan = plan_buckets([TensorSpec(f"w{i}", (1024, 1024), "float32") for i in range(8)])
>>> cost = lambda kind, n: collective_seconds(kind, n, 8, NETWORKS["ib400"])
>>> ddp = step_cost(plan, 8, "ddp", cost, forward_s=0.01, backward_s=0.02)
>>> z3 = step_cost(plan, 8, 3, cost, forward_s=0.01, backward_s=0.02)
>>> round(z3.wire_bytes / ddp.wire_bytes, 2)
1.5
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybrid.core._buckets import BucketPlan
from hybrid.core.cost._collectives import wire_bytes
from hybrid.core.cost._stream import exposed_seconds
from hybrid.core._zero3 import _check_prefetch, forward_order

STAGES = ("ddp", 1, 2, 3)
CollectiveCost = Callable[[str, float], float]  # (collective, nbytes) -> seconds


@dataclasses.dataclass(frozen=True, slots=True)
class StepCost:
    stage: object  # "ddp", 1, 2 or 3
    world_size: int
    wire_bytes: float  # sent by each rank per step
    comm_s: float  # every collective's time, added up
    exposed_s: float  # step time beyond compute: communication nothing hid
    step_s: float  # compute + exposed


def step_cost(plan: BucketPlan, world_size: int, stage, seconds: CollectiveCost, *, forward_s: float,
              backward_s: float, reshard_after_forward: bool = True, prefetch: int = 1) -> StepCost:
    """Simulate one step's compute and communication (see the module docstring)."""
    _check_prefetch(prefetch)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if forward_s < 0 or backward_s < 0:
        raise ValueError(f"compute times must be >= 0, got forward {forward_s}, backward {backward_s}")
    buckets = plan.buckets
    total = sum(b.length for b in buckets) or 1
    fwd = [forward_s * b.length / total for b in buckets]
    bwd = [backward_s * b.length / total for b in buckets]
    nbytes = [b.nbytes for b in buckets]
    compute, comm, volume = [], [], 0.0

    def send(name, kind, n, deps):
        nonlocal volume
        comm.append((name, seconds(kind, n), tuple(deps)))
        volume += wire_bytes(kind, n, world_size)

    last = len(buckets) - 1
    # A bucket's gather waits until the bucket `prefetch + 1` places ahead of it has computed (and
    # freed its buffer): at most prefetch + 1 buckets are gathered at once.
    ahead = prefetch + 1
    if stage == 3:
        order = forward_order(plan)  # the backward below runs in plan order: its reverse
        for k, b in enumerate(order):
            send(f"gather_f{b}", "all_gather", nbytes[b], [f"fwd{order[k - ahead]}"] if k >= ahead else [])
            compute.append((f"fwd{b}", fwd[b], [f"gather_f{b}"]))
    else:
        compute.append(("fwd", forward_s, []))
    for b in range(len(buckets)):
        needs = []
        if stage == 3 and reshard_after_forward:
            send(f"gather_b{b}", "all_gather", nbytes[b], [f"bwd{b - ahead}"] if b >= ahead else [])
            needs = [f"gather_b{b}"]
        compute.append((f"bwd{b}", bwd[b], needs))
        if stage in ("ddp", 1):
            send(f"reduce{b}", "all_reduce", nbytes[b], [f"bwd{b}"])
        else:
            send(f"reduce{b}", "reduce_scatter", nbytes[b], [f"bwd{b}"])
    after = [f"bwd{last}", f"reduce{last}"]
    if stage == 1:
        share = sum(nbytes) / world_size
        for r in range(world_size):
            send(f"broadcast{r}", "broadcast", share, after)
    elif stage == 2:
        for b in range(len(buckets)):
            send(f"gather{b}", "all_gather", nbytes[b], after)
    end, exposed = exposed_seconds(compute, comm)
    return StepCost(stage, world_size, volume, sum(c[1] for c in comm), exposed, end)
