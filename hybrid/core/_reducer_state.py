"""The DDP reducer's per-iteration state as one immutable value with pure transitions.

A backward pass is a sequence of "tensor i is ready" events. Each event lowers its bucket's pending
count; a bucket whose count reaches zero is ready, but buckets are *launched* strictly in bucket
order (bucket k only after 0..k-1), so every rank issues its collectives in the same order, as
torch's C++ ``Reducer`` does. The frontend owns the tensors and the collectives; this module only
decides what to launch when.

``mark_ready`` runs once per gradient per step, inside autograd, so the state is laid out for a
cheap transition: a NamedTuple (built by ``tuple.__new__``, no per-field ``__setattr__``), the
ready set as an int bitmask (membership and insertion without scanning), and the ready order as a
cons list ``(last, (previous, ...))`` that grows in O(1) and is unwound only when asked for. A
transition costs O(number of buckets) for the pending tuple, independent of the number of tensors
already marked (the former tuple scan and append made an iteration O(n^2)).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from hybrid.core._buckets import BucketPlan


class ReducerState(NamedTuple):
    """Where one backward pass stands.

    Attributes:
      bucket_of: bucket index of every tensor (indexed like the plan's specs).
      pending: per bucket, how many members are still awaited.
      next_bucket: the first bucket not yet launched; buckets ``[0, next_bucket)`` are launched.
      ready_mask: bit ``i`` is set once tensor ``i`` was marked ready.
      order_chain: the ready order as a cons list ``(last, (previous, (..., ())))``; read it as
        :attr:`ready_order`.
      num_ready: how many tensors were marked ready.
      unused: tensors marked ready without a gradient (not reachable from the outputs).
    """

    bucket_of: tuple[int, ...]
    pending: tuple[int, ...]
    next_bucket: int = 0
    ready_mask: int = 0
    order_chain: tuple = ()
    num_ready: int = 0
    unused: frozenset[int] = frozenset()

    @property
    def finished(self) -> bool:
        """Every bucket has been launched."""
        return self.next_bucket == len(self.pending)

    @property
    def started(self) -> bool:
        """At least one tensor was marked ready (so the iteration must be finalized)."""
        return self.num_ready > 0

    @property
    def ready_order(self) -> tuple[int, ...]:
        """Tensors in the order they were marked ready (what the rebuild consumes)."""
        out, chain = [], self.order_chain
        while chain:
            out.append(chain[0])
            chain = chain[1]
        return tuple(reversed(out))

    def is_ready(self, tensor: int) -> bool:
        """Whether ``tensor`` was marked ready in this iteration."""
        return bool(self.ready_mask >> tensor & 1)

    def missing(self) -> tuple[int, ...]:
        """Tensors not marked ready yet, in index order."""
        mask = self.ready_mask
        return tuple(i for i in range(len(self.bucket_of)) if not mask >> i & 1)


_new = tuple.__new__


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
    >>> launch, s.ready_order
    ((0, 1), (1, 2))
    """
    bucket_of, pending, nxt, mask, chain, num_ready, unused = state
    if not 0 <= tensor < len(bucket_of):
        raise ValueError(f"tensor index {tensor} is outside [0, {len(bucket_of)})")
    bit = 1 << tensor
    if mask & bit:
        raise RuntimeError(
            f"Expected to mark a variable ready only once. Tensor {tensor} was marked ready twice in "
            "this iteration (a parameter used by more than one reentrant backward, or shared "
            "across modules while the graph changes between iterations).")
    b = bucket_of[tensor]
    left = pending[b] - 1
    pending = pending[:b] + (left,) + pending[b + 1:]
    # _new(ReducerState, ...) is the NamedTuple's own constructor minus its Python-level __new__
    # frame: about a fifth of this function's cost, and it runs once per gradient.
    if left or b != nxt:  # the common case: nothing to launch
        return _new(ReducerState, (bucket_of, pending, nxt, mask | bit, (tensor, chain), num_ready + 1, unused)), ()
    end = nxt + 1
    while end < len(pending) and pending[end] == 0:
        end += 1
    new = _new(ReducerState, (bucket_of, pending, end, mask | bit, (tensor, chain), num_ready + 1, unused))
    return new, tuple(range(nxt, end))


def mark_unused(state: ReducerState, tensors: Iterable[int]) -> tuple[ReducerState, tuple[int, ...]]:
    """Mark tensors that will get no gradient this iteration as ready (``find_unused_parameters``).

    They are recorded in ``unused`` and take part in launching, as torch also marks them ready.

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
    return state._replace(unused=state.unused | frozenset(tensors)), launched
