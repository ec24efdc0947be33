"""Global decisions taken over several separate programs: the sum every bucket contributes first,
the step of each bucket with the total after.

:func:`hybrid.jax.clip_by_global_norm` and :func:`hybrid.jax.apply_if_finite` decide from one
number over all the updates they see (a sum of squares, a count of non-finite shards), summed over
the axis with ``psum``. Where the buckets are stepped by separate programs (``OffloadedZero3``
brings one bucket's state in at a time), no program sees every bucket; so, as DeepSpeed's offload
does for its global-norm clip, the step runs in two passes:

1. **measure**: each bucket's program runs the inner update under :func:`measuring` and returns
   the numbers its decisions would sum (already summed over the axis), in the order the decisions
   are traced;
2. **apply**: the totals over buckets are handed back in that order under :func:`applying`, and each
   bucket is stepped with the decisions the whole update would have taken.

Outside both (``zero``, ``bucketed_all_reduce``, a plain step), :func:`total` is the ``psum``.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_STATE = threading.local()


def _mode():
    return getattr(_STATE, "mode", None)


@contextlib.contextmanager
def measuring():
    """Trace with every global decision recording its bucket's contribution; yields the list it
    fills (``(kind, value)`` in trace order)."""
    recorded: list = []
    saved, _STATE.mode = _mode(), ("measure", recorded)
    try:
        yield recorded
    finally:
        _STATE.mode = saved


@contextlib.contextmanager
def applying(totals):
    """Trace with the global decisions taking ``totals`` (in the order :func:`measuring` recorded
    them) instead of their own sums."""
    saved, _STATE.mode = _mode(), ("apply", list(totals))
    try:
        yield
    finally:
        _STATE.mode = saved


def measuring_now() -> bool:
    """Whether the trace only measures (a decision may then skip control flow, e.g. ``lax.cond``,
    whose branches could not hand their measurement out)."""
    mode = _mode()
    return mode is not None and mode[0] == "measure"


def total(kind: str, local, axis_name):
    """The sum of ``local`` over ``axis_name``, and over every bucket where the buckets are stepped
    apart (see the module docstring)."""
    mode = _mode()
    if mode is None:
        return jax.lax.psum(local, axis_name)
    what, values = mode
    if what == "measure":
        summed = jax.lax.psum(local, axis_name)
        values.append((kind, summed))
        return summed
    if not values:
        raise AssertionError(f"{kind}: more global decisions traced than were measured")
    return values.pop(0)
