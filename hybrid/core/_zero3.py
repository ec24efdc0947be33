"""ZeRO stage 3 on a bucket plan: the order the forward uses buckets, what is gathered when, and
what a rank holds.

At stage 3 a rank keeps only its flat slice of every bucket (``shard_flat``: the layout of ZeRO-2's
gradient slices and of checkpoint files) for the parameters too. Before a bucket's parameters
are used they are all-gathered into the full (padded) bucket, and freed after their last use;
the backward gathers them again (``reshard_after_forward``, FSDP's default) or finds them kept.
Gradients are reduce-scattered per bucket into the owner's slice; the optimizer steps on slices.

The frontends share these decisions:

- :func:`forward_order` - buckets in the order the forward first uses them. Gathers are issued in
  this order; the backward runs it in reverse (the plan's own order: gradient-ready order).
- :func:`gather_windows` - the buckets held gathered while each bucket computes: itself and the
  next ``prefetch`` in the order (their all-gathers overlap its compute).
- :func:`zero3_memory` - per-rank bytes: slices of parameters, gradients and optimizer state, and
  the gathered working set (full buckets of a window, plus, in the backward, the full gradient of
  the bucket being reduce-scattered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan, _check_limits, _layout, plan_buckets, rebuild_plan
from hybrid.core._dtypes import itemsize
from hybrid.core._shard import FlatShardPlan
from hybrid.core._spec import check_specs


def forward_order(plan: BucketPlan, first_use: Sequence[int] | None = None) -> tuple[int, ...]:
    """Bucket indices in the order the forward first uses them.

    Without ``first_use``, the plan's reverse: ``plan_buckets`` fills buckets from the last
    registered tensor backwards (DDP's expected gradient-ready order), so for a model that uses
    its parameters in registration order the last bucket holds the first layers. ``first_use``
    gives the order observed instead (spec indices as the forward first read them: a torch forward
    pre-hook per module, or the order a traced JAX loss reads its leaves); buckets sort by their
    earliest member, and buckets none of whose members were seen come last, in reverse plan order.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(f"w{i}", (4,), "float32") for i in range(3)], size_limits=[16])
    >>> [[plan.specs[m].name for m in b.members] for b in plan.buckets]
    [['w2'], ['w1'], ['w0']]
    >>> forward_order(plan), forward_order(plan, first_use=[1, 0, 2])
    ((2, 1, 0), (1, 2, 0))
    """
    reverse = tuple(reversed(range(plan.num_buckets)))
    if first_use is None:
        return reverse
    first_use = [int(i) for i in first_use]
    n = len(plan.specs)
    bad = [i for i in first_use if not 0 <= i < n]
    repeated = sorted({i for i in first_use if first_use.count(i) > 1})
    if bad or repeated:
        raise ValueError(f"first_use must list spec indices in [0, {n}) at most once; out of range {bad}, "
                         f"repeated {repeated}")
    seen = {i: k for k, i in enumerate(first_use)}
    unseen = len(first_use)
    # (earliest member seen, position among unseen buckets): unseen buckets keep reverse plan order.
    key = {b: (min((seen.get(m, unseen) for m in plan.buckets[b].members), default=unseen), k)
           for k, b in enumerate(reverse)}
    return tuple(sorted(reverse, key=key.__getitem__))


def _check_order(order: Sequence[int], num_buckets: int) -> tuple[int, ...]:
    order = tuple(int(b) for b in order)
    if sorted(order) != list(range(num_buckets)):
        raise ValueError(f"order must hold every bucket index 0..{num_buckets - 1} once, got {list(order)}")
    return order


def _check_prefetch(prefetch) -> None:
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (buckets gathered ahead of the one computing), got {prefetch!r}")


def gather_windows(order: Sequence[int], prefetch: int = 1) -> tuple[tuple[int, ...], ...]:
    """The buckets held gathered while each bucket of ``order`` computes: itself and the next
    ``prefetch`` (whose all-gathers run during its compute). A bucket is gathered when it enters a
    window and freed when it leaves; run on the reversed order for the backward.

    >>> gather_windows((2, 1, 0)), gather_windows((2, 1, 0), prefetch=0)
    (((2, 1), (1, 0), (0,)), ((2,), (1,), (0,)))
    """
    _check_prefetch(prefetch)
    order = tuple(order)
    return tuple(order[k:k + prefetch + 1] for k in range(len(order)))


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Memory:
    """Bytes one rank holds at stage 3 (every rank alike: flat slices have one size).

    ``param_bytes``, ``grad_bytes`` and ``state_bytes`` persist between steps (the slices, padding
    included); ``gathered_bytes`` is the peak of full buckets held during a step.
    """

    param_bytes: int
    grad_bytes: int
    state_bytes: int
    gathered_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.state_bytes + self.gathered_bytes


def zero3_memory(shards: FlatShardPlan, state_bytes_per_param: int, *, prefetch: int = 1,
                 order: Sequence[int] | None = None, reshard_after_forward: bool = True) -> Zero3Memory:
    """A rank's memory at stage 3 on ``shards`` (``state_bytes_per_param``: the ``K`` of
    :func:`hybrid.core.zero_memory`).

    The gathered working set: in the forward, the full (padded) buckets of a :func:`gather_windows`
    window; in the backward, a window of the reversed order plus the full gradient of the bucket
    being reduce-scattered. With ``reshard_after_forward=False`` the forward's buckets are kept
    for the backward: at the turn every bucket is held, plus the first backward bucket's gradient.

    >>> from hybrid.core import TensorSpec, plan_buckets, shard_flat
    >>> plan = plan_buckets([TensorSpec(f"w{i}", (100,), "float32") for i in range(4)], size_limits=[400])
    >>> m = zero3_memory(shard_flat(plan, 4), 8)
    >>> m.param_bytes, m.state_bytes, m.gathered_bytes  # 4 slices of 25 floats; 2 buckets + 1 gradient
    (400, 800, 1200)
    >>> zero3_memory(shard_flat(plan, 4), 8, reshard_after_forward=False).gathered_bytes
    2000
    """
    _check_prefetch(prefetch)
    plan = shards.bucket_plan
    order = forward_order(plan) if order is None else _check_order(order, plan.num_buckets)
    full = [shards.padded_length(b) * itemsize(bucket.dtype) for b, bucket in enumerate(plan.buckets)]
    slices = sum(size * itemsize(bucket.dtype) for size, bucket in zip(shards.shard_sizes, plan.buckets))
    if not order:
        gathered = 0
    elif reshard_after_forward:
        forward = max(sum(full[b] for b in w) for w in gather_windows(order, prefetch))
        backward = max(sum(full[b] for b in w) + full[w[0]] for w in gather_windows(order[::-1], prefetch))
        gathered = max(forward, backward)
    else:
        gathered = sum(full) + full[order[-1]]
    return Zero3Memory(slices, slices, state_bytes_per_param * sum(shards.shard_sizes), gathered)


# Stage 3's default plan: about this many buckets, so that the gathered working set (the window
# of prefetch + 1 buckets, plus the gradient buckets in the backward: about 4 buckets) stays near a
# quarter of the parameters, and within these bounds: below the floor a bucket's collectives cost
# their latency more than their bytes (measured on gloo, 100 layers of 128 x 128 at 2 ranks: 15
# buckets of 0.4 MiB took 2.1x DDP's step, 7 of 1 MiB 1.2x), above the ceiling (DDP's cap) a
# bucket only adds working set.
ZERO3_BUCKETS = 16
ZERO3_CAP_FLOOR = 1 << 20
ZERO3_CAP_CEILING = 25 << 20


def zero3_bucket_cap(specs) -> int:
    """The default stage-3 bucket cap in bytes for these parameters: a ``1/16`` of their bytes,
    kept within 1 MiB and 25 MiB (DDP's cap). The first bucket is capped at ``min(1 MiB, cap)``
    as in DDP.

    >>> from hybrid.core import TensorSpec
    >>> zero3_bucket_cap([TensorSpec("w", (4096, 4096), "float32")])  # 64 MiB / 16
    4194304
    >>> zero3_bucket_cap([TensorSpec("w", (64, 64), "float32")]), zero3_bucket_cap([TensorSpec("w", (1 << 30,), "float32")])
    (1048576, 26214400)
    """
    total = sum(s.nbytes for s in check_specs(specs))
    return min(ZERO3_CAP_CEILING, max(ZERO3_CAP_FLOOR, total // ZERO3_BUCKETS))


def zero3_plan(specs, *, bucket_cap_bytes: int | None = None, first_bucket_cap_bytes: int | None = None) -> BucketPlan:
    """Stage 3's bucket plan: the tensors assigned in reverse registration order, the buckets in
    that order (bucket 0 the last layers), caps ``(first, cap)`` with ``cap``
    :func:`zero3_bucket_cap` and ``first`` ``min(1 MiB, cap)`` by default (a ``first`` at or
    above ``cap`` is ignored, as in :func:`plan_buckets`).

    It is the plan DDP rebuilds after its first iteration when gradients arrive in reverse
    registration order, and a bucket is the unit of gathering here: assigned backwards, a bucket
    closes after the tensor that fills it, which is a module's first tensor (its weight), so a
    module's tensors share a bucket unless they exceed the cap. ``plan_buckets`` assigns forwards,
    as DDP's first plan does, and would put a layer's bias with the next layer's weight: every
    layer would need two buckets gathered.

    >>> from hybrid.core import TensorSpec
    >>> specs = [TensorSpec(n, s, "float32") for n, s in [("0.w", (64, 64)), ("0.b", (64,)),
    ...                                                   ("1.w", (64, 64)), ("1.b", (64,))]]
    >>> [[specs[m].name for m in b] for b in zero3_plan(specs, bucket_cap_bytes=8192).bucket_indices()]
    [['1.b', '1.w'], ['0.b', '0.w']]
    >>> [[specs[m].name for m in b] for b in plan_buckets(specs, bucket_cap_bytes=8192).bucket_indices()]
    [['1.b'], ['0.b', '1.w'], ['0.w']]
    """
    specs = check_specs(specs)
    cap = zero3_bucket_cap(specs) if bucket_cap_bytes is None else int(bucket_cap_bytes)
    first = min(1 << 20, cap) if first_bucket_cap_bytes is None else int(first_bucket_cap_bytes)
    limits = _check_limits(cap, first)  # as plan_buckets: a first cap at or above the cap is ignored
    return rebuild_plan(plan_buckets(specs, size_limits=limits), list(reversed(range(len(specs)))), size_limits=limits)


def zero3_group_plan(specs, groups) -> BucketPlan:
    """Stage 3's memory-first plan: a bucket per group of tensors (``groups[i]``: tensor ``i``'s
    group, e.g. the module that holds it: FSDP2's unit when ``fully_shard`` wraps every layer),
    whatever its size, so a rank holds at most a group or two gathered at a time.

    As in :func:`zero3_plan`, tensors and buckets run in reverse registration order (bucket 0 holds
    the last group registered); a group whose tensors have two dtypes gets a bucket per dtype.

    >>> from hybrid.core import TensorSpec
    >>> specs = [TensorSpec(n, s, "float32") for n, s in [("0.w", (64, 64)), ("0.b", (64,)),
    ...                                                   ("1.w", (8, 64)), ("1.b", (8,))]]
    >>> [[specs[m].name for m in b] for b in zero3_group_plan(specs, [0, 0, 1, 1]).bucket_indices()]
    [['1.b', '1.w'], ['0.b', '0.w']]
    """
    specs = check_specs(specs)
    groups = list(groups)
    if len(groups) != len(specs):
        raise ValueError(f"groups must give one group per tensor: {len(groups)} for {len(specs)} tensors")
    members: dict[tuple, list[int]] = {}
    for i in reversed(range(len(specs))):
        members.setdefault((groups[i], specs[i].dtype, specs[i].device), []).append(i)
    buckets = tuple(_layout(specs, m, sum(specs[i].nbytes for i in m), 1) for m in members.values())
    return BucketPlan(specs, buckets, (max(b.size_limit for b in buckets),), 1)

