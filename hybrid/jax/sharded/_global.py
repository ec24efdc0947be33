"""Global flat buckets under a plain ``jax.jit``: what ``zero(..., mesh=mesh)`` and stage 3's
``shard_params(..., mesh=mesh)`` / ``gather_params`` share outside ``shard_map``.

A bucket here is one global array, the whole padded bucket, whose ``NamedSharding`` says where its
elements live: ``P(axis)`` gives each device the slice ``shard_flat`` gives it inside ``shard_map``
(a bucket's padded length is a multiple of the axis size), ``P()`` every device the whole bucket.
Moving between the two is a ``with_sharding_constraint``; XLA's partitioner inserts the collective.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybrid.core import bucket_pieces, forward_order, pack
from hybrid.jax._all_reduce import _bound


def check_mesh(mesh, axis_name, what: str) -> int:
    """The size of ``mesh``'s axis ``axis_name``, or an error naming the argument."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis_name, str) or axis_name not in mesh.shape:
        raise ValueError(f"{what}: axis {axis_name!r} is not an axis of the mesh (its axes: {tuple(mesh.shape)})")
    return mesh.shape[axis_name]


def global_buckets(layout, shards, tree, sharding, replicated=None) -> tuple:
    """The tree's padded flat buckets (``hybrid.core.pack``), each constrained to ``sharding``; the
    leaves first to ``replicated`` where given (a gradient leaf is reduced as a leaf, then packed:
    without it XLA:CPU's partitioner resharded every leaf to build the sharded concatenate, one
    all-gather per leaf)."""
    arrays = layout.spec_arrays(tree)
    if replicated is not None:
        arrays = [jax.lax.with_sharding_constraint(a, replicated) for a in arrays]
    return tuple(jax.lax.with_sharding_constraint(pack(layout.plan, b, arrays, length=shards.padded_length(b)),
                                                  sharding)
                 for b in range(layout.plan.num_buckets))


def mesh_of(shards):
    """The mesh global ParamShards live on, as jit sees it (an abstract mesh inside a trace, the
    concrete one outside); None where their type names no mesh with their axis, or where their
    axis is bound (inside ``shard_map`` or ``pmap``: the shards are a device's slices there)."""
    axis_name = shards.layout.axis_name
    if _bound(axis_name):
        return None
    for x in shards.buckets:
        sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and axis_name in getattr(mesh, "shape", {}):
            return mesh
    mesh = jax.sharding.get_abstract_mesh()  # jax.set_mesh(...) around the step
    return mesh if axis_name in getattr(mesh, "shape", {}) else None


def gather_global(shards, mesh):
    """The params tree from global ParamShards inside jit: each bucket constrained to ``P()``
    (XLA's all-gather), split at ``hybrid.core.bucket_pieces`` (whose transpose packs the gradients
    with one concatenate), in forward order. The bucket is constrained to ``P(axis)`` first, so
    the gradient ``jax.grad`` returns for it is ``P(axis)`` too: each device keeps its slice."""
    lay = shards.layout
    plan = lay.layout.plan
    sharded, replicated = NamedSharding(mesh, P(lay.axis_name)), NamedSharding(mesh, P())
    per_spec = {}
    for b in forward_order(plan):
        full = shards.buckets[b]
        if full.shape[0]:
            full = jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(full, sharded), replicated)
        pieces = bucket_pieces(plan, b, length=full.shape[0])
        for (m, _), part in zip(pieces, jax.lax.split(full, [k for _, k in pieces])):
            if m is not None:
                per_spec[m] = part.reshape(plan.specs[m].shape)
    return lay.layout.unflatten(per_spec)
