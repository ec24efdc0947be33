"""Bucket boundaries chosen from the cost model: the plan that ends the backward's communication
soonest, given when each gradient becomes ready and what collectives and copies cost.

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
  end_{k-1} + gap(n_k))``);
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

:func:`predict_step` runs that timeline for any plan; :func:`auto_plan` finds, by dynamic
programming over the ready order, the contiguous buckets (and which single-tensor buckets skip
the copy) that minimise the step's end, exactly for this model (tests check it against brute
force). Its result is an ordinary :class:`~hybrid.core.BucketPlan`, fingerprinted as any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan, _layout
from hybrid.core._spec import TensorSpec, check_specs
from hybrid.core.cost._collectives import stream_ends


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


def _after_cost(cost, after_step, nbytes: float, first: bool) -> float:
    """The after-step collectives of one bucket inside their back-to-back train: each adds its gap;
    the train's first collective costs its whole time."""
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
    ends = stream_ends([(at, cost.seconds(kind, n), cost.gap(kind, n)) for at, n in zip(launches, sizes)])
    backward_end = compute_end + delay
    chain = backward_end
    for b, e in zip(plan.buckets, ends):
        chain = max(chain, e) + (0.0 if b.in_place else copy.seconds(b.nbytes))
    back = sum(0.0 if b.in_place else copy.seconds(b.nbytes) for b in plan.buckets)
    serial = max(backward_end, ends[-1]) + back
    end = overlap * chain + (1 - overlap) * serial
    end += sum(_after_cost(cost, after_step, n, k == 0) for k, n in enumerate(sizes))
    return StepTimeline(tuple(launches), tuple(ends), backward_end, end, end - compute_end)


# Up to this many tensors of one key the search cuts between any two; past it, between atoms.
EXACT_TENSORS = 48


def atoms(nbytes: Sequence[int]) -> list[tuple[int, int]]:
    """Runs ``(start, stop)`` of consecutive tensors that buckets are cut between: each tensor alone
    up to :data:`EXACT_TENSORS` tensors; past that, neighbours merged while a run stays within
    1/64 of the bytes (a tensor bigger than that alone), which bounds the runs by about 128.

    >>> atoms([4, 4, 4])
    [(0, 1), (1, 2), (2, 3)]
    >>> len(atoms([64] * 200)), atoms([1] * 60 + [10 ** 6])[-1]
    (67, (60, 61))
    """
    if len(nbytes) <= EXACT_TENSORS:
        return [(k, k + 1) for k in range(len(nbytes))]
    limit, out, start, size = sum(nbytes) / 64, [], 0, 0
    for k, n in enumerate(nbytes):
        if k > start and size + n > limit:
            out.append((start, k))
            start, size = k, 0
        size += n
    out.append((start, len(nbytes)))
    return out


def _plan_key(specs, order, times, cost, copy, kind, after_step, in_place, compute_end, cum_before, overlap):
    """The DP over one (dtype, device) key's tensors ``order`` (ready order, ``times`` theirs):
    returns the buckets as runs ``(start, stop)`` of ``order``. ``cum_before[k]``: bytes of every
    tensor (of any key) ready up to ``order[k]``, for the thread's copy delay.

    A state is a cut of a prefix into buckets, kept while no other cut of the same prefix is at
    least as good in every one of: the last collective's end, the write-back chain (max over
    buckets of its end plus the copies back of it and every later bucket), the copies back so far,
    and the additive rest (bucket launches, after-step collectives). A bucket delays every later
    event on the backward's thread (its launch, and the share of its collective the compute
    feels); times are kept net of those delays so far, so the state does not grow with them (they
    live on in the additive part). A state's value can only
    grow as buckets are added (``final``), so states already worse than a complete plan found by a
    greedy first pass are dropped, as are buckets whose collective alone ends past it (a bigger
    bucket's ends later still): both exact, and they keep the search fast.
    """
    nbytes = [specs[i].nbytes for i in order]
    cuts = atoms(nbytes)
    n = len(cuts)
    per_bucket = copy.seconds_per_bucket
    backward_end = compute_end + copy.seconds(cum_before[-1])
    runs: dict = {}

    def run(start, stop):
        # atoms [start, stop) as one bucket: its collective's end and its gap net of the delay it
        # puts on the thread, copy back, additive part (as a later bucket, and its extra as the first)
        key = (start, stop)
        if key not in runs:
            lo, hi = cuts[start][0], cuts[stop - 1][1]
            size = sum(nbytes[lo:hi])
            t = cost.seconds(kind, size)
            delay = per_bucket + (1 - overlap) * t if stop < n else per_bucket  # the last runs after the backward
            back = 0.0 if (hi - lo == 1 and in_place) else copy.seconds(size)
            later = _after_cost(cost, after_step, size, False)
            runs[key] = (times[hi - 1] + copy.seconds(cum_before[hi - 1]) + per_bucket + t - delay,
                         cost.gap(kind, size) - delay, back, delay + later, delay,
                         _after_cost(cost, after_step, size, True) - later)
        return runs[key]

    def final(s):
        # the step's end (net of the thread's delays, which live in s[3]): overlapped, serial, blended
        return overlap * max(backward_end + s[2], s[1]) + (1 - overlap) * (max(backward_end, s[0]) + s[2]) + s[3]

    def search(bound, width):
        # a state: (end, chain, out, rest, start atom, previous state); end and chain net of launches
        fronts: list[list[tuple]] = [[] for _ in range(n + 1)]
        fronts[0] = [(-math.inf, -math.inf, 0.0, 0.0, 0, None)]
        for stop in range(1, n + 1):
            front: list[tuple] = []
            for start in range(stop - 1, -1, -1):
                alone, gap, back, rest, delay, first = run(start, stop)
                if alone > bound:
                    break
                for s in fronts[start]:
                    end = max(alone, s[0] + gap)
                    new = (end, max(s[1] - delay, end) + back, s[2] + back,
                           s[3] + rest + (first if s[5] is None else 0.0), start, s)
                    if final(new) > bound or any(f[0] <= new[0] and f[1] <= new[1] and f[2] <= new[2]
                                                 and f[3] <= new[3] for f in front):
                        continue
                    front = [f for f in front if not (new[0] <= f[0] and new[1] <= f[1] and new[2] <= f[2]
                                                      and new[3] <= f[3])]
                    front.append(new)
            fronts[stop] = sorted(front, key=final)[:width]
        return min(fronts[n], key=final)

    greedy = search(math.inf, 1)  # a complete plan: its value bounds the exact search
    best = search(final(greedy) * (1 + 1e-12), n + 1)
    out, stop = [], n
    while best[5] is not None:
        out.append((cuts[best[4]][0], cuts[stop - 1][1]))
        stop, best = best[4], best[5]
    return out[::-1]


def auto_plan(specs: Sequence[TensorSpec], ready_order: Sequence[int], ready_s: Sequence[float], cost, *,
              copy: CopyCost = CopyCost(), kind: str = "all_reduce", in_place: bool = True,
              after_step: Sequence[tuple[str, int]] = (), backward_s: float | None = None,
              overlap: float = 1.0) -> BucketPlan:
    """The bucket plan that minimises :func:`predict_step`'s end of the step.

    Buckets are contiguous runs of ``ready_order`` (as DDP's rebuilt buckets are), one dtype and
    device each; a sparse gradient gets a bucket of its own. With ``in_place`` a one-tensor
    bucket is reduced where its gradient lies (``Bucket.in_place``: no buffer, no copy). Each
    bucket's ``size_limit`` is its own size, and ``plan.size_limits`` the sizes in order: for one
    dtype and device, ``rebuild_plan(plan, ready_order, size_limits=auto.size_limits)`` builds the
    same buckets (what a frontend that takes caps can be given).

    Exact for one dtype and device (the dynamic program keeps, per prefix of the ready order,
    every cut no other beats in last end, write-back chain, copies back and additive time), over
    :func:`atoms`: between any two tensors up to :data:`EXACT_TENSORS` of them, between runs of
    1/64 of the bytes past that. Several keys are planned one by one, each on its own tensors.

    Args: as :func:`predict_step`, plus ``in_place`` (whether the frontend can reduce a gradient
    where it lies: not with mixed precision's reduce dtype, nor with ``gradient_as_bucket_view``,
    whose gradients live in the buckets already).

    >>> from hybrid.core import CostModel
    >>> model = CostModel.fit([("all_reduce", n, 1e-4 + n * 1e-9) for n in (1 << 10, 1 << 24)], world_size=2)
    >>> specs = [TensorSpec(f"w{i}", (1 << 20,), "float32") for i in range(3)]  # 4 MiB each
    >>> plan = auto_plan(specs, [2, 1, 0], [0.01, 0.02, 0.03], model, copy=CopyCost(1e-10))
    >>> plan.bucket_indices(), [b.in_place for b in plan.buckets]  # every gradient reduced as it comes
    ([[2], [1], [0]], [True, True, True])
    >>> small = [TensorSpec(f"b{i}", (256,), "float32") for i in range(3)]  # latency-bound: one bucket
    >>> auto_plan(small, [2, 1, 0], [0.0, 0.0, 0.0], model, copy=CopyCost(1e-10)).bucket_indices()
    [[2, 1, 0]]
    """
    specs = check_specs(specs)
    if not specs:
        raise ValueError("auto_plan needs at least one tensor, got none")
    for k, parts in after_step:
        if not (isinstance(parts, int) and parts >= 1):
            raise ValueError(f"after_step parts must be ints >= 1, got {parts!r} for {k!r}")
    order, times, compute_end = _check_inputs(specs, ready_order, ready_s, backward_s)
    _check_overlap(overlap)
    cum, total = [], 0
    for i in order:
        total += specs[i].nbytes
        cum.append(total)
    runs = []  # (position in the ready order of the bucket's last tensor, members)
    keys = sorted({(s.dtype, s.device) for s in specs if not s.sparse})
    for key in keys:
        pos = [k for k, i in enumerate(order) if (specs[i].dtype, specs[i].device) == key and not specs[i].sparse]
        cuts = _plan_key(specs, [order[k] for k in pos], [times[k] for k in pos], cost, copy, kind, after_step,
                         in_place, compute_end, [cum[k] for k in pos], overlap)
        runs += [(pos[stop - 1], [order[k] for k in pos[start:stop]]) for start, stop in cuts]
    runs += [(k, [i]) for k, i in enumerate(order) if specs[i].sparse]
    runs.sort(key=lambda r: r[0])  # launch order: by when the bucket's last gradient is ready
    buckets = []
    for _, members in runs:
        size = sum(specs[m].nbytes for m in members)
        b = _layout(specs, members, 0 if specs[members[0]].sparse else size, 1)
        if in_place and len(members) == 1 and not b.sparse:
            b = dataclasses.replace(b, in_place=True)
        buckets.append(b)
    return BucketPlan(specs, tuple(buckets), tuple(b.size_limit for b in buckets), 1)


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
