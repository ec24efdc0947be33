"""The DDP reducer's per-iteration state as one frozen value with pure transitions.

A backward pass is a sequence of "tensor i is ready" events. Each event lowers its bucket's pending
count; a bucket whose count reaches zero is ready, but buckets are *launched* strictly in bucket
order (bucket k only after 0..k-1), so every rank issues its collectives in the same order, as
torch's C++ ``Reducer`` does. The frontend owns the tensors and the collectives; this module only
decides what to launch when.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from hybrid.core._buckets import BucketPlan


@dataclasses.dataclass(frozen=True, slots=True)
class ReducerState:
    """Where one backward pass stands.

    Attributes:
      bucket_of: bucket index of every tensor (indexed like the plan's specs).
      pending: per bucket, how many members are still awaited.
      next_bucket: the first bucket not yet launched; buckets ``[0, next_bucket)`` are launched.
      ready_order: tensors in the order they were marked ready (what the rebuild consumes).
      unused: tensors marked ready without a gradient (not reachable from the outputs).
    """

    bucket_of: tuple[int, ...]
    pending: tuple[int, ...]
    next_bucket: int = 0
    ready_order: tuple[int, ...] = ()
    unused: frozenset[int] = frozenset()

    def __post_init__(self):
        if len(self.pending) and not 0 <= self.next_bucket <= len(self.pending):
            raise ValueError(f"next_bucket {self.next_bucket} is outside [0, {len(self.pending)}]")

    @property
    def finished(self) -> bool:
        """Every bucket has been launched."""
        return self.next_bucket == len(self.pending)

    @property
    def started(self) -> bool:
        """At least one tensor was marked ready (so the iteration must be finalized)."""
        return bool(self.ready_order)

    def missing(self) -> tuple[int, ...]:
        """Tensors not marked ready yet, in index order."""
        seen = set(self.ready_order)
        return tuple(i for i in range(len(self.bucket_of)) if i not in seen)


def start_iteration(plan: BucketPlan) -> ReducerState:
    """A fresh state for one backward pass over ``plan``.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(f"p{i}", (256,), "float32") for i in range(3)],
    ...                     bucket_cap_bytes=1024, first_bucket_cap_bytes=1024)
    >>> start_iteration(plan).pending
    (1, 1, 1)
    """
    bucket_of = [0] * len(plan.specs)
    for b, bucket in enumerate(plan.buckets):
        for m in bucket.members:
            bucket_of[m] = b
    return ReducerState(tuple(bucket_of), tuple(len(b.members) for b in plan.buckets))


def mark_ready(state: ReducerState, tensor: int) -> tuple[ReducerState, tuple[int, ...]]:
    """Mark ``tensor``'s gradient ready; returns the new state and the buckets to launch now.

    The returned buckets are consecutive and start at the old ``next_bucket``: a bucket that becomes
    ready out of order waits until every earlier bucket is ready.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(f"p{i}", (256,), "float32") for i in range(3)],
    ...                     bucket_cap_bytes=1024, first_bucket_cap_bytes=1024)
    >>> s = start_iteration(plan)       # buckets: [[2], [1], [0]]
    >>> s, launch = mark_ready(s, 1)    # bucket 1 ready, but bucket 0 is not
    >>> launch
    ()
    >>> s, launch = mark_ready(s, 2)
    >>> launch
    (0, 1)
    """
    if not 0 <= tensor < len(state.bucket_of):
        raise ValueError(f"tensor index {tensor} is outside [0, {len(state.bucket_of)})")
    b = state.bucket_of[tensor]
    if state.pending[b] == 0 or tensor in state.ready_order:
        raise RuntimeError(
            f"Expected to mark a variable ready only once. Tensor {tensor} was marked ready twice in "
            "this iteration (a parameter used by more than one reentrant backward, or shared "
            "across modules while the graph changes between iterations).")
    pending = state.pending[:b] + (state.pending[b] - 1,) + state.pending[b + 1:]
    nxt = state.next_bucket
    while nxt < len(pending) and pending[nxt] == 0:
        nxt += 1
    # Direct construction: this runs once per gradient per step (dataclasses.replace is ~3x slower).
    new = ReducerState(state.bucket_of, pending, nxt, state.ready_order + (tensor,), state.unused)
    return new, tuple(range(state.next_bucket, nxt))


def mark_unused(state: ReducerState, tensors: Iterable[int]) -> tuple[ReducerState, tuple[int, ...]]:
    """Mark tensors that will get no gradient this iteration as ready (``find_unused_parameters``).

    They are recorded in ``unused`` but not in ``ready_order``'s rebuild sense: torch also marks
    them ready, so they take part in launching.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(f"p{i}", (4,), "float32") for i in range(2)])
    >>> s, launch = mark_unused(start_iteration(plan), [0, 1])
    >>> launch, sorted(s.unused)
    ((0,), [0, 1])
    """
    launched: tuple[int, ...] = ()
    tensors = tuple(tensors)
    for t in tensors:
        state, now = mark_ready(state, t)
        launched += now
    return dataclasses.replace(state, unused=state.unused | frozenset(tensors)), launched
