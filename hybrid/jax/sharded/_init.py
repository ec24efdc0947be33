"""ZeRO-3 parameters born sharded: the global :class:`ParamShards` of an init function, each device
holding only its slices, without any device (or process) holding the params tree replicated.

:func:`init_shards` runs the init function and the packing into flat buckets in one ``jax.jit``
whose outputs are the padded buckets sharded over the mesh axis: what ``shard_map`` returns for
:func:`hybrid.jax.shard_params` with ``out_specs=P(axis)``, bit for bit (the same ops, and JAX's
partitionable threefry makes random bits independent of how XLA splits the work). How the
computation is split is XLA's choice: on XLA:CPU a device computes whole buckets and keeps its
slice of each, so its transient memory is that of the init's temporaries (``memory_analysis``
of the compiled init says how much), while what it holds afterwards is its slices only.

:func:`abstract_shards` is the same layout as ``jax.ShapeDtypeStruct`` s with their shardings, from
the params or their shapes (``jax.eval_shape(model.init, ...)``): a template that
``hybrid.checkpoint.jax.load`` fills, each process reading only its own devices' slices.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybrid.core import BucketPlan, ParamPairing
from hybrid.jax._copy import pack_bucket
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
    ``axis_name``, each device holding only its slice of every bucket: no replicated params tree.

    The plan options are :func:`hybrid.jax.shard_params`'s. Under ``jax.distributed`` every process
    calls it alike (one jitted program over the global mesh).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> init = lambda key: {"w": jax.random.normal(key, (3,)), "b": jnp.zeros(2)}
    >>> shards = init_shards(init, jax.random.key(0), mesh=mesh, axis_name="dp")
    >>> [s.data.shape for s in shards.buckets[0].addressable_shards]  # 5 elements, padded to 2 x 3
    [(3,), (3,)]
    """
    program, shard_layout = born_sharded(init_fn, *args, mesh=mesh, axis_name=axis_name, order=order,
                                         pairing=pairing, plan=plan, bucket_cap_bytes=bucket_cap_bytes,
                                         first_bucket_cap_bytes=first_bucket_cap_bytes, **kwargs)
    return ParamShards(tuple(program(*args, **kwargs)), shard_layout)


def born_sharded(init_fn, *args, mesh: Mesh, axis_name: str, **plan_and_kwargs):
    """``(the jitted program of init_shards, its ShardLayout)``: the program's padded buckets come
    out sharded; ``.lower(*args).compile().memory_analysis()`` says what it needs per device."""
    plan = {k: plan_and_kwargs.pop(k) for k in ("order", "pairing", "plan", "bucket_cap_bytes",
                                                "first_bucket_cap_bytes")}
    abstract = jax.eval_shape(init_fn, *args, **plan_and_kwargs)
    layout, shard_layout, sharding = _layout(abstract, mesh, axis_name, "init_shards", **plan)
    shards = shard_layout.shards

    def buckets(*args, **kwargs):
        arrays = layout.spec_arrays(init_fn(*args, **kwargs))
        return tuple(pack_bucket(layout.plan, b, arrays, length=shards.padded_length(b), cuda=False)
                     for b in range(layout.plan.num_buckets))

    return jax.jit(buckets, out_shardings=(sharding,) * layout.plan.num_buckets), shard_layout


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
