"""Global-norm clipping that is exact on ZeRO's shards and on reduced (replicated) updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hybrid.jax._decisions import total as across
from hybrid.jax.sharded._on_shards import running_on_shards
from hybrid.jax._specs import axis_size, tracks_varying, varying_axes


def _squares(updates, axis_name, what: str):
    """``(sharded, whole)``: sums of squares of the leaves split over the axis, and of the others."""
    pairs = jax.tree_util.tree_flatten_with_path(updates)[0]
    # Squares summed in each leaf's own dtype, as optax.tree.norm does.
    if running_on_shards(axis_name):  # zero's inner: every leaf is this device's disjoint slice
        return [jnp.sum(x * x) for _, x in pairs], []
    if not tracks_varying(axis_name):
        raise ValueError(
            f"{what}: cannot tell whether the updates are shards or replicated over {axis_name!r}: JAX "
            f"tracks no variance here (pmap, or shard_map(..., check_vma=False)), and this is not inside "
            f"hybrid.jax.zero. Inside zero(chain(hybrid.jax.clip_by_global_norm(...), inner), {axis_name!r}) it "
            f"is exact; on reduced updates (after hybrid.jax.bucketed_all_reduce) every device holds the "
            f"whole gradient, so use optax.clip_by_global_norm there")
    sharded = [jnp.sum(x * x) for _, x in pairs if axis_name in varying_axes(x)]
    whole = [jnp.sum(x * x) for _, x in pairs if axis_name not in varying_axes(x)]
    return sharded, whole


def clip_by_global_norm(max_norm: float, axis_name) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for updates sharded over, or replicated over, ``axis_name``.

    The global norm counts every element once: a leaf that varies over the axis is this device's
    part of the whole (inside :func:`hybrid.jax.zero` every leaf is a disjoint slice of a bucket),
    so its squared norm is summed over the axis; a leaf that is the same on every device (after
    :func:`hybrid.jax.bucketed_all_reduce`) is counted once. Inside ``zero`` it is exact
    everywhere; elsewhere the leaves' types say which is which, which JAX tracks inside
    ``jax.shard_map`` with its default ``check_vma=True``. Under ``pmap`` or ``check_vma=False``
    outside ``zero`` it raises a ValueError (use ``optax.clip_by_global_norm`` on reduced updates).
    The clipping rule is optax's (``select(norm < max_norm, t, t / norm * max_norm)``), so
    ``zero(chain(clip_by_global_norm(c, "dp"), inner), "dp")`` and
    ``chain(bucketed_all_reduce("dp"), clip_by_global_norm(c, "dp"), inner)`` equal
    ``chain(optax.clip_by_global_norm(c), inner)`` unsharded.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    >>> tx = clip_by_global_norm(1.0, "dp")
    >>> clip = lambda u: tx.update(u, tx.init(u))[0]
    >>> u = jnp.full(4, 1.0)  # a 4-element vector of ones: norm 2
    >>> jax.shard_map(clip, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(u).tolist()  # one element per device
    [0.5, 0.5, 0.5, 0.5]
    >>> jax.shard_map(clip, mesh=mesh, in_specs=P(), out_specs=P())(u).tolist()  # the whole vector on each
    [0.5, 0.5, 0.5, 0.5]
    """

    def update_fn(updates, state, params=None):
        del params
        axis_size(axis_name, "clip_by_global_norm")
        sharded, whole = _squares(updates, axis_name, "clip_by_global_norm")
        # psum of the shards' part; where buckets step apart (OffloadedZero3), every bucket's too
        total = sum(whole) + (across("clip_by_global_norm", sum(sharded), axis_name) if sharded else 0)
        g_norm = jnp.sqrt(total)
        trigger = g_norm < max_norm
        updates = jax.tree_util.tree_map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
