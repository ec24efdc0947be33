"""Bucket boundaries chosen from the cost model: the plan that ends the backward's communication
soonest, given when each gradient becomes ready and what collectives and copies cost.

The step is :func:`hybrid.core.cost.predict_step`'s timeline (hybrid.core.cost._timeline, where
its model is written out). :func:`auto_plan` finds, by dynamic programming over the ready order,
the contiguous buckets (and which single-tensor buckets skip the copy) that minimise the step's
end, exactly for that model up to :data:`EXACT_SEARCH` atoms (tests check it against brute
force). Its result is an ordinary :class:`~hybrid.core.BucketPlan`, fingerprinted as any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan, _layout
from hybrid.core._spec import TensorSpec, check_specs
from hybrid.core.cost._timeline import CopyCost, _after_cost, _check_inputs, _check_overlap, _gaps


def _largest_measured(cost, kind: str) -> float:
    """The largest size ``cost`` measured ``kind`` at (``inf`` where it does not say). Past it a
    model extrapolates from its last two sizes, and a plan that bets on that line can lose: on this
    project's 2-core VM a 21M MLP planned as one 80 MiB bucket, predicted 4% faster than torch's
    caps from the 16-32 MiB slope, ran 7% slower than torch, where a bucket per tensor ran 12% faster."""
    fit = getattr(cost, "fits", {}).get(kind)
    return float(fit.sizes[-1]) if fit is not None and fit.sizes else math.inf


def _depends_on_previous(cost, kind: str) -> bool:
    """Whether a collective's gap in ``cost`` can depend on the one before it (a model with mixed
    trains measured; any other object that answers ``train_gaps``)."""
    if not hasattr(cost, "train_gaps"):
        return False
    fit = getattr(cost, "fits", {}).get(kind)
    return fit is None or any(a > g for a, g in zip(fit.after_small, fit.gaps))


def _largest_loss(cost, kind: str, starts: Sequence[int]) -> float:
    """The most any bucket adds behind a small collective over behind its own size
    (``gap_after_small - gap``); ``starts``: the bytes before each atom, and all of them. Both
    are interpolated between the same measured sizes (and extrapolated past the largest), so for
    a :class:`~hybrid.core.CostModel` the most is at one of those sizes or at all the bytes;
    otherwise every bucket the search can form is asked."""
    total = starts[-1]
    fit = getattr(cost, "fits", {}).get(kind)
    if fit is not None and fit.sizes:
        candidates = [n for n in fit.sizes if n <= total] + [total]
    else:
        candidates = {b - a for i, a in enumerate(starts) for b in starts[i + 1:]}
    return max(max(0.0, a - g) for g, a, _ in (_gaps(cost, kind, n) for n in candidates))


# Up to this many tensors of one key the search cuts between any two; past it, between atoms.
EXACT_TENSORS = 48
# Up to this many atoms the search keeps every cut no other dominates (exact); past it, the n + 1
# best of them per prefix (a beam: 24 atoms plan in 0.05 s, 48 unbounded took 17 s).
EXACT_SEARCH = 24


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
    and the additive rest (bucket launches, after-step collectives), and, where the model's gap
    depends on the collective before (:func:`_gaps`), the last bucket's collective time (a longer
    one hides more of the next: larger is better). A bucket delays every later
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
    before = [0]  # bytes before each tensor of the key, and all of them
    for b in nbytes:
        before.append(before[-1] + b)
    starts = [before[lo] for lo, _ in cuts] + [before[-1]]  # the same, per atom
    largest = _largest_measured(cost, kind)
    by_previous = _depends_on_previous(cost, kind)
    small_s = _gaps(cost, kind, 1)[2]  # the small collective's time, the same for every size
    loss = _largest_loss(cost, kind, starts) if by_previous else 0.0
    runs: dict = {}

    def run(start, stop):
        # atoms [start, stop) as one bucket: its collective's end and its gap net of the delay it
        # puts on the thread, copy back, additive part (as a later bucket, and its extra as the first)
        key = (start, stop)
        if key not in runs:
            lo, hi = cuts[start][0], cuts[stop - 1][1]
            size = starts[stop] - starts[start]
            t = cost.seconds(kind, size)
            gap, after_small, _ = _gaps(cost, kind, size)
            delay = per_bucket + (1 - overlap) * t if stop < n else per_bucket  # the last runs after the backward
            back = 0.0 if (hi - lo == 1 and in_place) else copy.seconds(size)
            later = _after_cost(cost, after_step, size, False)
            runs[key] = (times[hi - 1] + copy.seconds(cum_before[hi - 1]) + per_bucket + t - delay,
                         gap - delay, back, delay + later, delay,
                         _after_cost(cost, after_step, size, True) - later, t, after_small - gap)
        return runs[key]

    def dominates(f, g):
        if not (f[1] <= g[1] and f[2] <= g[2] and f[3] <= g[3]):
            return False
        if not by_previous:
            return f[0] <= g[0]
        # f's next bucket ends no later than g's: f's last collective is at least as long, or f
        # ends so much sooner that the most a short predecessor can add does not matter
        return f[0] <= g[0] and (f[6] >= g[6] or f[0] + max(0.0, loss - max(0.0, f[6] - small_s)) <= g[0])

    def final(s):
        # the step's end (net of the thread's delays, which live in s[3]): overlapped, serial, blended
        return overlap * max(backward_end + s[2], s[1]) + (1 - overlap) * (max(backward_end, s[0]) + s[2]) + s[3]

    def search(bound, width):
        # a state: (end, chain, out, rest, start atom, previous state, its last collective's time);
        # end and chain net of launches
        fronts: list[list[tuple]] = [[] for _ in range(n + 1)]
        fronts[0] = [(-math.inf, -math.inf, 0.0, 0.0, 0, None, math.inf)]
        for stop in range(1, n + 1):
            front: list[tuple] = []
            for start in range(stop - 1, -1, -1):
                if stop - start > 1 and starts[stop] - starts[start] > largest:
                    break  # a bucket of several atoms past the sizes measured: not planned on a guess
                alone, gap, back, rest, delay, first, t, small_extra = run(start, stop)
                if alone > bound:
                    break
                for s in fronts[start]:
                    # behind a shorter collective, up to the gap after a small one (stream_ends)
                    short = 0.0 if s[6] >= t else max(0.0, small_extra - max(0.0, s[6] - small_s))
                    end = max(alone, s[0] + gap + short)
                    new = (end, max(s[1] - delay, end) + back, s[2] + back,
                           s[3] + rest + (first if s[5] is None else 0.0), start, s, t)
                    if final(new) > bound or any(dominates(f, new) for f in front):
                        continue
                    front = [f for f in front if not dominates(new, f)]
                    front.append(new)
            fronts[stop] = sorted(front, key=final)[:width]
        return min(fronts[n], key=final)

    greedy = search(math.inf, 1)  # a complete plan: its value bounds the exact search
    # exact up to EXACT_SEARCH atoms; past that, a beam (the front grows fast: 48 tensors took 17 s)
    best = search(final(greedy) * (1 + 1e-12), None if n <= EXACT_SEARCH else n + 1)
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
    every cut no other beats in last end, write-back chain, copies back and additive time, and
    where the model's gaps depend on the collective before, the last bucket's time), over
    :func:`atoms`: between any two tensors up to :data:`EXACT_TENSORS` of them, between runs of
    1/64 of the bytes past that; past :data:`EXACT_SEARCH` atoms, the ``n + 1`` best cuts per
    prefix (a beam). Several keys are planned one by one, each on its own tensors. No bucket of
    several tensors is bigger than the largest size the model measured (a single tensor may be).

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
