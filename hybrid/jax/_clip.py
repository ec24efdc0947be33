"""Global-norm clipping that is exact when each device holds a disjoint shard of the updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hybrid.jax._specs import axis_size


def clip_by_global_norm(max_norm: float, axis_name) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for updates sharded over ``axis_name``.

    Each device holds a disjoint part of the updates (as inside :func:`hybrid.jax.zero`), so the
    global norm is the square root of the per-device squared norms summed over the axis. The
    clipping rule is optax's (``select(norm < max_norm, t, t / norm * max_norm)``), so
    ``zero(chain(clip_by_global_norm(c, "dp"), inner), "dp")`` equals
    ``chain(optax.clip_by_global_norm(c), inner)`` unsharded. Do not use it on replicated updates:
    the norm would count every element ``world_size`` times.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> tx = clip_by_global_norm(1.0, "dp")
    >>> u = jnp.full((4, 1), 1.0)  # a 4-element vector of ones, one element per device: norm 2
    >>> out, _ = jax.pmap(lambda u: tx.update(u, tx.init(u)), axis_name="dp")(u)
    >>> np.asarray(out).ravel().tolist()
    [0.5, 0.5, 0.5, 0.5]
    """

    def update_fn(updates, state, params=None):
        del params
        axis_size(axis_name, "clip_by_global_norm")
        # Squares summed in each leaf's own dtype, as optax.tree.norm does.
        local = sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(updates))
        g_norm = jnp.sqrt(jax.lax.psum(local, axis_name))
        trigger = g_norm < max_norm
        updates = jax.tree_util.tree_map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
