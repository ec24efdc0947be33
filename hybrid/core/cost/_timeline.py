"""The reducer's timeline for a bucket plan, under the cost model: when each bucket launches and
ends, and when the step does.

The step, as hybrid's reducer runs it (and torch's C++ reducer, whose steps are the same):

- the backward computes gradients in ``ready_order``, gradient ``i`` at ``ready_s[i]`` (pure
  compute: seconds since the backward began, without any of the reducer's own work);
- on the backward's thread each gradient's hook makes one pass over it (copied into its bucket
  with the ``1/world`` scale fused in, or, in an in-place bucket, scaled where it lies):
  ``copy.seconds_per_byte`` per byte; a bucket whose last gradient arrives is launched
  (``copy.seconds_per_bucket``: the bookkeeping and the collective's launch). That work delays
  everything after it on the thread, the rest of the backward included;
- the buckets' collectives run in launch order on one stream that may overlap consecutive ones
  (:func:`hybrid.core.cost.stream_ends`: bucket ``k`` ends at ``max(launch_k + seconds(n_k),
  end_{k-1} + gap_k)``, where ``gap_k`` is ``gap(n_k)`` behind a bucket at least as long and
  up to ``gap_after_small(n_k)`` behind a short one);
- a collective hides behind the backward's compute only as far as they do not share an engine:
  ``overlap`` is the fraction of a collective's time the compute does not feel (1 for NCCL's
  own engine on a GPU; on a CPU whose cores the ranks fill, gloo's threads and the backward take
  turns, and ``overlap`` is near 0). Every bucket but the last (launched when the backward ends)
  delays the backward's thread by ``(1 - overlap)`` of its collective's time;
- after the backward, each bucket in turn is waited for and copied back into the gradients
  (another pass, none for an in-place bucket); with ``overlap`` below 1 those copies and the
  collectives still running take turns too: the step's end is ``overlap`` of the overlapped end
  and ``1 - overlap`` of the serial one (the last collective's end or the backward's, whichever is
  later, plus every copy back);
- optionally, collectives after the step for every bucket (``after_step``: ZeRO-2's parameter
  gathers), a train issued back to back.

:func:`predict_step` runs that timeline for any plan (torch's default caps included);
:func:`hybrid.core.cost.auto_plan` searches for the plan it says ends soonest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan
from hybrid.core._spec import TensorSpec
from hybrid.core.cost._stream import stream_ends


@dataclasses.dataclass(frozen=True, slots=True)
class CopyCost:
    """What moving gradients through buckets costs the backward's thread.

    ``seconds_per_byte``: one pass over a gradient (into its bucket with the scale fused in, or
    back out); ``seconds_per_bucket``: the fixed work of launching one bucket.

    >>> CopyCost(1e-10, 2e-5).seconds(1 << 20)
    0.0001048576
    """

    seconds_per_byte: float = 0.0
    seconds_per_bucket: float = 0.0

    def __post_init__(self):
        for name in ("seconds_per_byte", "seconds_per_bucket"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CopyCost.{name} must be a finite number >= 0, got {value!r}")

    def seconds(self, nbytes: float) -> float:
        return self.seconds_per_byte * nbytes


@dataclasses.dataclass(frozen=True, slots=True)
class StepTimeline:
    """What :func:`predict_step` predicts for one plan (seconds from the backward's start)."""

    launches: tuple[float, ...]  # when each bucket's collective is issued
    ends: tuple[float, ...]  # when it completes
    backward_end_s: float  # the backward's end, its hooks' work included
    end_s: float  # the gradients written back (and the after-step collectives done)
    exposed_s: float  # end_s minus the backward's pure compute: what the reducer added


def _check_inputs(specs, ready_order, ready_s, backward_s):
    n = len(specs)
    order = [int(i) for i in ready_order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"ready_order must name each of the {n} tensors once, got {order}")
    times = [float(t) for t in ready_s]
    if len(times) != n or any(not (math.isfinite(t) and t >= 0) for t in times):
        raise ValueError(f"ready_s must hold {n} finite times >= 0 (one per ready_order entry), got {list(ready_s)}")
    # A gradient cannot be ready before one the backward computed earlier: times along the order
    # never fall (a clock read late makes the next one look early; the later reading wins).
    for k in range(1, n):
        times[k] = max(times[k], times[k - 1])
    end = times[-1] if n else 0.0
    if backward_s is not None:
        if not (math.isfinite(backward_s) and backward_s >= 0):
            raise ValueError(f"backward_s must be a finite time >= 0, got {backward_s!r}")
        end = max(end, float(backward_s))
    return order, times, end


def _check_overlap(overlap) -> None:
    if not (isinstance(overlap, (int, float)) and 0 <= overlap <= 1):
        raise ValueError(f"overlap must be a fraction in [0, 1], got {overlap!r}")


def _gaps(cost, kind: str, nbytes: float) -> tuple[float, float, float]:
    """A collective's gaps in a train, as :meth:`hybrid.core.CostModel.train_gaps` gives them
    (behind its own size, behind a small one, the small one's time); the first twice where
    ``cost`` has only :meth:`~hybrid.core.CostModel.gap`."""
    if hasattr(cost, "train_gaps"):
        return cost.train_gaps(kind, nbytes)
    gap = cost.gap(kind, nbytes)
    return gap, gap, 0.0


def _after_cost(cost, after_step, nbytes: float, first: bool) -> float:
    """The after-step collectives of one bucket inside their back-to-back train: each adds its gap;
    the train's first collective costs its whole time. (Their same-size gap throughout: a bucket's
    parts follow each other, and only its first follows another bucket's; the search keeps this
    part additive.)"""
    total = 0.0
    for kind, parts in after_step:
        n = nbytes / parts
        total += parts * cost.gap(kind, n)
        if first:
            total += cost.seconds(kind, n) - cost.gap(kind, n)
            first = False
    return total


def predict_step(plan: BucketPlan, ready_order: Sequence[int], ready_s: Sequence[float], cost, *,
                 copy: CopyCost = CopyCost(), kind: str = "all_reduce", after_step: Sequence[tuple[str, int]] = (),
                 backward_s: float | None = None, overlap: float = 1.0) -> StepTimeline:
    """The reducer's timeline for ``plan`` (see the module docstring).

    Args:
      plan: any bucket plan over the same tensors; buckets launch in plan order, each once all its
        members are ready (torch's rule), ``in_place`` buckets copy nothing.
      ready_order / ready_s: tensor indices in the order their gradients become ready, and when.
      cost: a :class:`~hybrid.core.CostModel` (or anything with ``seconds(kind, n)`` and
        ``gap(kind, n)``).
      copy: the backward thread's cost of passes over gradients and of launching buckets.
      kind: the collective each bucket runs (``"all_reduce"``; ZeRO-2: ``"reduce_scatter"``).
      after_step: ``(collective, parts)`` per bucket after the step: ``parts`` collectives of
        ``nbytes / parts`` each (hybrid's ZeRO-2 on gloo: ``[("broadcast", world)]``; on NCCL
        ``[("all_gather", 1)]``).
      backward_s: when the backward's compute ends (default: the last gradient's ready time).
      overlap: the fraction of a collective's time that hides behind the backward's compute
        (1: none of it is felt; 0: all of it delays the backward), measured by the frontend.

    >>> from hybrid.core import CostModel, plan_buckets
    >>> model = CostModel.fit([("all_reduce", n, 1e-4 + n * 1e-9) for n in (1 << 10, 1 << 24)], world_size=2)
    >>> plan = plan_buckets([TensorSpec("w", (1 << 18,), "float32")])
    >>> round(predict_step(plan, [0], [0.01], model).exposed_s * 1e3, 3)  # all-reduce of 1 MiB, alone
    1.149
    """
    order, times, compute_end = _check_inputs(plan.specs, ready_order, ready_s, backward_s)
    _check_overlap(overlap)
    bucket_of = {m: b for b, bucket in enumerate(plan.buckets) for m in bucket.members}
    remaining = [len(b.members) for b in plan.buckets]
    sizes = [b.nbytes for b in plan.buckets]
    launches: list[float] = []
    delay = 0.0
    for i, t in zip(order, times):
        delay += copy.seconds(plan.specs[i].nbytes)
        remaining[bucket_of[i]] -= 1
        while len(launches) < len(remaining) and remaining[len(launches)] == 0:
            delay += copy.seconds_per_bucket
            launches.append(t + delay)
            if len(launches) < len(remaining):  # not the last: its collective runs beside the backward
                delay += (1 - overlap) * cost.seconds(kind, sizes[len(launches) - 1])
    ends = stream_ends([(at, cost.seconds(kind, n), *_gaps(cost, kind, n)) for at, n in zip(launches, sizes)])
    backward_end = compute_end + delay
    chain = backward_end
    for b, e in zip(plan.buckets, ends):
        chain = max(chain, e) + (0.0 if b.in_place else copy.seconds(b.nbytes))
    back = sum(0.0 if b.in_place else copy.seconds(b.nbytes) for b in plan.buckets)
    serial = max(backward_end, ends[-1]) + back
    end = overlap * chain + (1 - overlap) * serial
    end += sum(_after_cost(cost, after_step, n, k == 0) for k, n in enumerate(sizes))
    return StepTimeline(tuple(launches), tuple(ends), backward_end, end, end - compute_end)


def ready_times_by_elements(specs: Sequence[TensorSpec], ready_order: Sequence[int], backward_s: float) -> list[float]:
    """Ready times when nothing measured them: the backward's ``backward_s`` shared out in
    proportion to each gradient's elements, in ready order (a dense layer's backward FLOPs are
    proportional to its parameters). What a frontend that cannot time its backward (JAX, inside
    one XLA program) plans with.

    >>> specs = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (1,), "float32")]
    >>> ready_times_by_elements(specs, [1, 0], 1.0)
    [0.25, 1.0]
    """
    if not (math.isfinite(backward_s) and backward_s >= 0):
        raise ValueError(f"backward_s must be a finite time >= 0, got {backward_s!r}")
    total = sum(specs[i].numel for i in ready_order) or 1
    out, done = [], 0
    for i in ready_order:
        done += specs[i].numel
        out.append(backward_s * done / total)
    return out
