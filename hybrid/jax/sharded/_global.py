"""Global flat buckets under a plain ``jax.jit``: what ``zero(..., mesh=mesh)`` and stage 3's
``shard_params(..., mesh=mesh)`` / ``gather_params`` share outside ``shard_map``.

A bucket here is one global array, the whole padded bucket, whose ``NamedSharding`` says where its
elements live: ``P(axis)`` gives each device the slice ``shard_flat`` gives it inside ``shard_map``
(a bucket's padded length is a multiple of the axis size), ``P()`` every device the whole bucket.
Moving between the two is a ``with_sharding_constraint``; XLA's partitioner inserts the collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def global_buckets(layout, shards, tree, sharding) -> tuple:
    """The tree's padded flat buckets (``hybrid.core.pack``), each constrained to ``sharding``."""
    arrays = layout.spec_arrays(tree)
    return tuple(jax.lax.with_sharding_constraint(pack(layout.plan, b, arrays, length=shards.padded_length(b)),
                                                  sharding)
                 for b in range(layout.plan.num_buckets))


def own_slices(plan, shards, members: tuple, rank, *, riders: tuple = (), through=None) -> list:
    """Device ``rank``'s slice of every bucket of each tree in ``members`` (per tree, a list or dict
    of ``spec index -> leaf``), copied from the leaves by static slices. Returns, per bucket, a
    tuple of one slice per tree, then ``through(riders[b])`` where ``riders`` (one array per bucket)
    are given.

    One ``lax.switch`` on ``rank`` picks the branch whose static slices of the members
    (``FlatShardPlan.shard_range`` over ``hybrid.core.bucket_pieces``, zeros for the padding) make
    that device's slices. Packing the whole bucket and slicing it gives the same values, but
    XLA:CPU materialises the whole bucket on every device for it. Everything in the one branch
    happens at one point of the step: the slices are copied only once every rider exists (pass the
    reduce-scattered gradient slices as riders and the parameters' slices are not copied during
    the forward and held through the backward), and no bucket's result exists before every
    bucket's riders (so an in-place update of one bucket's parameters is ordered after the last
    backward read of them, by another bucket's gradient: XLA needs no defensive copy)."""
    num_trees = len(members)
    live = [b for b in range(plan.num_buckets) if shards.shard_sizes[b]]

    def pieces_of(b, r):
        start, stop = shards.shard_range(b, r)
        pieces, at = [], 0
        for m, k in bucket_pieces(plan, b, length=shards.padded_length(b)):
            lo, hi = max(at, start) - at, min(at + k, stop) - at
            if lo < hi:
                pieces.append((m, lo, hi))
            at += k
        return pieces

    def branch(r):
        """Rank ``r``'s slices of every bucket from its members: static slices and zero gaps."""
        def sliced(ms, extra):
            out = []
            for i, b in enumerate(live):
                dtype = plan.buckets[b].dtype
                own = tuple(jnp.concatenate([jnp.zeros((hi - lo,), dtype) if m is None else
                                             ms[t][m].reshape(-1)[lo:hi] for m, lo, hi in pieces_of(b, r)])
                            for t in range(num_trees))
                out.append(own + ((through(extra[i]),) if riders else ()))
            return tuple(out)
        return sliced

    ms = tuple({m: members[t][m] for b in live for m in plan.buckets[b].members} for t in range(num_trees))
    extra = tuple(riders[b] for b in live) if riders else ()
    got = iter(jax.lax.switch(rank, [branch(r) for r in range(shards.world_size)], ms, extra) if live else ())
    empty = lambda b: jnp.zeros((0,), plan.buckets[b].dtype)
    return [next(got) if shards.shard_sizes[b] else
            (empty(b),) * num_trees + ((through(riders[b]),) if riders else ()) for b in range(plan.num_buckets)]


def local_buckets(layout, shards, trees, mesh, axis_name: str) -> list:
    """Each tree's buckets sharded ``P(axis_name)`` (global arrays), each device copying only its own
    slice (:func:`own_slices`). The trees (gradients and params, of one layout) are sliced in the
    same branch, so XLA cannot copy the params' slices before the gradients exist (and hold them
    through the backward). The trees' leaves must be the same on every device (replicated: params,
    reduced gradients)."""
    plan = layout.plan
    num_trees = len(trees)

    def run(*flat):
        it = iter(flat)
        members = [dict() for _ in range(num_trees)]
        for bucket in plan.buckets:
            for t in range(num_trees):
                for m in bucket.members:
                    members[t][m] = next(it)
        return tuple(own_slices(plan, shards, tuple(members), jax.lax.axis_index(axis_name)))

    arrays = [layout.spec_arrays(tree) for tree in trees]
    flat_members = [a[m] for bucket in plan.buckets for a in arrays for m in bucket.members]
    per_bucket = jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(axis_name),
                               check_vma=False)(*flat_members)
    return [tuple(bucket[t] for bucket in per_bucket) for t in range(num_trees)]


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


def batch_specs(args, axis_name: str, n: int, what: str, *, shards_at: int | None = None) -> tuple:
    """``shard_map`` in_specs for positional ``args`` run per device under a plain jit: every array
    split over ``axis_name`` on its first dimension (the batch, a multiple of the ``n`` devices),
    scalars replicated, the ParamShards at ``shards_at`` ``P(axis_name)``; an error names ``what``
    and the argument whose rows do not split."""
    def spec(i, path, x):
        if getattr(x, "ndim", 0) == 0:
            return P()
        if x.shape[0] % n:
            raise ValueError(f"{what}: argument {i}{jax.tree_util.keystr(path)} has {x.shape[0]} rows, not a "
                             f"multiple of the {n} devices over {axis_name!r}: under a plain jit every array "
                             f"argument besides the shards is the batch, split over the axis on its first dimension")
        return P(axis_name)

    return tuple(P(axis_name) if i == shards_at else jax.tree_util.tree_map_with_path(
        lambda path, x, i=i: spec(i, path, x), a) for i, a in enumerate(args))


def per_device_mean(fun, args, kwargs, argnums: int, mesh, axis_name: str):
    """``fun(*args)`` for global ParamShards at ``argnums`` under a plain jit, run per device inside
    ``shard_map``: the shards ``P(axis)`` (each device its slices, gathered inside ``fun``), every
    other array argument split over the axis on its first dimension (the batch), scalars
    replicated; the outputs averaged over the axis (``pmean``). For a loss that is a mean over
    the batch, the mean of the devices' means over equal parts is the loss of the whole batch, and
    ``jax.grad``'s transpose of the gathers is one reduce-scatter per bucket (XLA:CPU turns a
    ``P()`` constraint's transpose into an all-reduce of the whole gradient and a slice)."""
    if kwargs:
        raise TypeError(f"gathered: under a plain jit on global ParamShards pass the batch positionally "
                        f"(got keyword arguments {sorted(kwargs)}): every positional array is split over "
                        f"{axis_name!r} on its first dimension")
    specs = batch_specs(args, axis_name, mesh.shape[axis_name], "gathered", shards_at=argnums)

    def local(*a):
        return jax.tree.map(lambda v: jax.lax.pmean(v, axis_name), fun(*a))

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(*args)
