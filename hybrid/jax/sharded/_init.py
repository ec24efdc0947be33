"""ZeRO-3 parameters born sharded: the global :class:`ParamShards` of an init function, each device
computing and holding only its share, without any device (or process) holding the params tree.

:func:`init_shards` runs in two steps, as XLA can split them:

1. **The init, each parameter sharded.** One jitted program whose outputs are the parameters,
   each padded to a multiple of the axis size in its rows and flattened, sharded over the mesh
   axis (a device's chunk is whole rows of every parameter). XLA's
   partitioner splits the initialisers by those shardings (JAX's partitionable threefry makes a
   random element's bits a function of its index alone), so a device computes ``1 / N`` of every
   parameter and holds that.
2. **Into the buckets' slices, a bucket at a time.** For each bucket a small program concatenates
   its members' chunks into the padded flat bucket with the output sharded over the axis: XLA
   moves the elements between devices (gathering that bucket, not more), and the chunks of the
   bucket's members are dropped before the next bucket.

A device's peak is its share of the parameters plus one bucket; its compute is its share of the
initialisers. The values are what ``shard_map`` returns for :func:`hybrid.jax.shard_params` of the
jitted init with ``out_specs=P(axis)``, bit for bit (the same ops per element).

Why not one program from the init to the buckets' slices: a bucket's slices do not follow any
parameter's shape, so XLA's partitioner computes whole buckets on every device there.

:func:`abstract_shards` is the same layout as ``jax.ShapeDtypeStruct`` s with their shardings, from
the params or their shapes (``jax.eval_shape(model.init, ...)``): a template that
``hybrid.checkpoint.jax.load`` fills, each process reading only its own devices' slices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybrid.core import BucketPlan, FlatShardPlan, ParamPairing, pack
from hybrid.jax._specs import _Layout, check_caps
from hybrid.jax.sharded._params import ParamShards, ShardLayout


def _layout(params, mesh: Mesh, axis_name: str, what: str, **plan) -> tuple[_Layout, ShardLayout, NamedSharding]:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"{what}: the mesh has axes {tuple(mesh.shape)}, not {axis_name!r}")
    check_caps(plan["bucket_cap_bytes"], plan["first_bucket_cap_bytes"], none_ok=True)
    layout = _Layout.zero3(params, what=what, **plan)
    shards = layout.shards(mesh.shape[axis_name])
    return layout, ShardLayout(layout, shards, axis_name), NamedSharding(mesh, P(axis_name))


def init_shards(init_fn, *args, mesh: Mesh, axis_name: str, bucket_cap_bytes: int | None = None,
                first_bucket_cap_bytes: int | None = None, order=None, pairing: ParamPairing | None = None,
                plan: BucketPlan | None = None, **kwargs) -> ParamShards:
    """``shard_params(init_fn(*args, **kwargs))`` as global :class:`ParamShards` over ``mesh``'s
    ``axis_name``, each device computing ``1 / N`` of the init and holding only its slice of every bucket:
    no replicated params tree.

    The plan options are :func:`hybrid.jax.shard_params`'s. Under ``jax.distributed`` every process
    calls it alike; each computes the slices of its own devices only, with no communication.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> init = lambda key: {"w": jax.random.normal(key, (3,)), "b": jnp.zeros(2)}
    >>> shards = init_shards(init, jax.random.key(0), mesh=mesh, axis_name="dp")
    >>> [s.data.shape for s in shards.buckets[0].addressable_shards]  # 5 elements, padded to 2 x 3
    [(3,), (3,)]
    """
    born = born_sharded(init_fn, *args, mesh=mesh, axis_name=axis_name, order=order, pairing=pairing,
                        plan=plan, bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes,
                        **kwargs)
    return born(*args, **kwargs)


class BornSharded:
    """The programs of :func:`init_shards` over one layout: :meth:`init_program` (the parameters,
    each flat and sharded over the axis) and :meth:`bucket_program` (one bucket's slices from its
    members' chunks). Call it with the init's arguments for the global :class:`ParamShards`;
    :meth:`temp_bytes` is the most working memory XLA says one of the programs needs per device.
    """

    def __init__(self, init_fn, layout: _Layout, shard_layout: ShardLayout, sharding: NamedSharding):
        self.layout, self.shard_layout, self.sharding = layout, shard_layout, sharding
        axis_size = shard_layout.shards.world_size

        def chunks(*args, **kwargs):
            return [_padded_flat(x, axis_size) for x in layout.spec_arrays(init_fn(*args, **kwargs))]

        self.init_program = jax.jit(chunks, out_shardings=[sharding] * len(layout.plan.specs))
        self._bucket_programs = {}

    def bucket_program(self, bucket: int):
        """The jitted program from bucket ``bucket``'s members' chunks to its slices."""
        if bucket not in self._bucket_programs:
            self._bucket_programs[bucket] = jax.jit(functools.partial(_bucket_of, self.shard_layout.shards, bucket),
                                                    out_shardings=self.sharding)
        return self._bucket_programs[bucket]

    def temp_bytes(self, *args, **kwargs) -> int:
        """The largest ``temp_size_in_bytes`` per device among the compiled init and bucket programs."""
        temps = [self.init_program.lower(*args, **kwargs).compile().memory_analysis().temp_size_in_bytes]
        chunks = jax.eval_shape(self.init_program, *args, **kwargs)
        for b, bucket in enumerate(self.layout.plan.buckets):
            members = [jax.ShapeDtypeStruct(chunks[m].shape, chunks[m].dtype, sharding=self.sharding)
                       for m in bucket.members]
            temps.append(self.bucket_program(b).lower(*members).compile().memory_analysis().temp_size_in_bytes)
        return max(temps)

    def __call__(self, *args, **kwargs) -> ParamShards:
        chunks = list(self.init_program(*args, **kwargs))
        buckets = []
        for b, bucket in enumerate(self.layout.plan.buckets):
            buckets.append(self.bucket_program(b)(*(chunks[m] for m in bucket.members)))
            for m in bucket.members:  # its slices hold these elements now
                chunks[m] = None
        return ParamShards(tuple(buckets), self.shard_layout)


def born_sharded(init_fn, *args, mesh: Mesh, axis_name: str, **plan_and_kwargs) -> BornSharded:
    """The :class:`BornSharded` programs of ``init_shards(init_fn, *args, ...)``: the layout is
    planned from ``jax.eval_shape`` of the init; nothing is computed yet."""
    plan = {k: plan_and_kwargs.pop(k) for k in ("order", "pairing", "plan", "bucket_cap_bytes",
                                                "first_bucket_cap_bytes")}
    abstract = jax.eval_shape(init_fn, *args, **plan_and_kwargs)
    layout, shard_layout, sharding = _layout(abstract, mesh, axis_name, "init_shards", **plan)
    return BornSharded(init_fn, layout, shard_layout, sharding)


def _padded_flat(x, axis_size: int):
    """``x`` with its first dimension padded with zeros to a multiple of ``axis_size``, flattened:
    its elements first, in order, and a shape XLA shards evenly over the axis by ``x``'s rows (a
    flat cut through the middle of a row would not follow ``x``'s shape, and XLA computes the
    whole of ``x`` on every device for it)."""
    x = jnp.reshape(x, (1,)) if x.ndim == 0 else x
    x = jnp.pad(x, [(0, -x.shape[0] % axis_size)] + [(0, 0)] * (x.ndim - 1))
    return jnp.reshape(x, (-1,))


def _bucket_of(shards: FlatShardPlan, bucket: int, *chunks):
    """Bucket ``bucket`` padded to its sharded length, from its members' padded flat chunks (in
    member order): :func:`hybrid.core.pack` of the members, each its chunk's first elements."""
    plan = shards.bucket_plan
    arrays = [None] * len(plan.specs)  # pack reads the bucket's members only
    for m, n, flat in zip(plan.buckets[bucket].members, plan.buckets[bucket].numels, chunks):
        arrays[m] = jnp.reshape(flat[:n], plan.specs[m].shape)
    return pack(plan, bucket, arrays, length=shards.padded_length(bucket))


def abstract_shards(params, *, mesh: Mesh, axis_name: str, bucket_cap_bytes: int | None = None,
                    first_bucket_cap_bytes: int | None = None, order=None, pairing: ParamPairing | None = None,
                    plan: BucketPlan | None = None) -> ParamShards:
    """The global :class:`ParamShards` of ``params`` (arrays or ``jax.ShapeDtypeStruct`` s, e.g.
    ``jax.eval_shape(model.init, ...)``) as ``jax.ShapeDtypeStruct`` s with their shardings: the
    template to load a checkpoint straight into slices (``hybrid.checkpoint.jax.load``).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> abstract = abstract_shards({"w": jax.ShapeDtypeStruct((5,), jnp.float32)}, mesh=mesh, axis_name="dp")
    >>> abstract.buckets[0].shape, abstract.buckets[0].sharding.spec
    ((6,), P('dp',))
    """
    layout, shard_layout, sharding = _layout(params, mesh, axis_name, "abstract_shards", order=order,
                                             pairing=pairing, plan=plan, bucket_cap_bytes=bucket_cap_bytes,
                                             first_bucket_cap_bytes=first_bucket_cap_bytes)
    shards = shard_layout.shards
    return ParamShards(tuple(jax.ShapeDtypeStruct((shards.padded_length(b),), bucket.dtype, sharding=sharding)
                             for b, bucket in enumerate(layout.plan.buckets)), shard_layout)
