"""Whether a transform is running on ZeRO's flat shards: ``zero`` says so while it runs its inner one.

``hybrid.jax.clip_by_global_norm`` must sum squared norms over the axis on disjoint shards and
must not on replicated updates. Inside ``shard_map`` JAX's types tell the two apart (shards vary
over the axis, reduced updates do not); under ``pmap`` or ``check_vma=False`` they do not, but
``zero`` knows what it hands its inner transform, so it marks the trace while calling it.
"""

from __future__ import annotations

import contextlib
import contextvars

_AXES = contextvars.ContextVar("hybrid_jax_on_shards", default=frozenset())


@contextlib.contextmanager
def on_shards(axis_name):
    """Mark the transforms traced inside as running on disjoint shards over ``axis_name``."""
    token = _AXES.set(_AXES.get() | {axis_name})
    try:
        yield
    finally:
        _AXES.reset(token)


def running_on_shards(axis_name) -> bool:
    """Whether the caller is traced by ``zero`` (or its probe) over ``axis_name``."""
    return axis_name in _AXES.get()
