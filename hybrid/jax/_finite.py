"""Skipping non-finite steps with one decision over all devices, exact inside ``zero``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hybrid.jax._decisions import measuring_now, total as across
from hybrid.jax._specs import axis_size


def apply_if_finite(inner: optax.GradientTransformation, max_consecutive_errors: int,
                    axis_name) -> optax.GradientTransformation:
    """``optax.apply_if_finite`` for updates sharded over ``axis_name``: one skip decision for all.

    Each device holds a disjoint part of the updates (as inside :func:`hybrid.jax.zero`); the
    update is skipped on every device when any element on any device is NaN or infinite (the
    count of non-finite shards is summed over the axis), as ``optax.apply_if_finite`` skips the
    whole update unsharded. The state is optax's ``ApplyIfFiniteState``; its counters are the same
    on every device. After more than ``max_consecutive_errors`` non-finite steps in a row the
    update is applied anyway, as optax does.

    Args:
      inner: the transform to guard (elementwise, to be exact inside ``zero``).
      max_consecutive_errors: non-finite steps in a row that are skipped.
      axis_name: the axis the updates are sharded over.

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> tx = apply_if_finite(optax.sgd(1.0), 3, "dp")
    >>> u = jnp.array([[1.0], [jnp.nan], [1.0], [1.0]])  # one element per device, one NaN
    >>> out, state = jax.pmap(lambda u: tx.update(u, tx.init(u)), axis_name="dp")(u)
    >>> np.asarray(out).ravel().tolist(), np.asarray(state.last_finite).tolist()
    ([0.0, 0.0, 0.0, 0.0], [False, False, False, False])
    """

    def init_fn(params):
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32),
                                        last_finite=jnp.array(True, jnp.bool_),
                                        total_notfinite=jnp.zeros([], jnp.int32),
                                        inner_state=inner.init(params))

    def update_fn(updates, state, params=None):
        axis_size(axis_name, "apply_if_finite")
        local = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(updates)]))
        # summed over the axis; where buckets step apart (OffloadedZero3), over every bucket too
        isfinite = across("apply_if_finite", jnp.logical_not(local).astype(jnp.int32), axis_name) == 0
        notfinite_count = jnp.where(isfinite, jnp.zeros([], jnp.int32),
                                    optax.safe_increment(state.notfinite_count))

        def reject(_):
            return jax.tree_util.tree_map(jnp.zeros_like, updates), state.inner_state

        if measuring_now():  # only the decisions' sums count; a cond's branch could not hand them out
            updates, inner_state = inner.update(updates, state.inner_state, params)
        else:
            updates, inner_state = jax.lax.cond(
                jnp.logical_or(isfinite, notfinite_count > max_consecutive_errors),
                lambda _: inner.update(updates, state.inner_state, params), reject, None)
        total = jnp.where(isfinite, state.total_notfinite, optax.safe_increment(state.total_notfinite))
        return updates, optax.ApplyIfFiniteState(notfinite_count=notfinite_count, last_finite=isfinite,
                                                 total_notfinite=total, inner_state=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)
