"""ZeRO-3's parameters: each device holds its flat slice of every bucket, gathered where the loss uses them.

:class:`ParamShards` is the pytree of those slices, with the plan that cut them as static
metadata (so ``jax.grad``, ``optax.apply_updates`` and ``shard_map`` keep it, and a mismatch is
a trace-time error). :func:`shard_params` cuts a replicated params tree (no communication),
:func:`gather_params` all-gathers every bucket back into the tree inside the loss (its transpose,
what ``jax.grad`` runs in the backward, is one reduce-scatter per bucket: the gradient comes out
as this device's slice, summed over the axis), :func:`gathered` wraps a loss of params into a
loss of shards that gathers again in the backward instead of keeping the gathered parameters,
and :func:`unshard_params` turns the global shards back into the tree, outside ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hybrid.core import BucketPlan, FlatShardPlan, ParamPairing, bucket_pieces, forward_order, unpack
from hybrid.jax._copy import check_backend, pack_bucket, use_kernels
from hybrid.jax._specs import _Layout, axis_size, check_caps
from hybrid.jax.sharded._global import check_mesh, gather_global, global_buckets, mesh_of, per_device_mean
from hybrid.jax.sharded._xla_flags import cse_merges_regathers, split_bucket


@dataclasses.dataclass(frozen=True, eq=False)
class ShardLayout:
    """How :class:`ParamShards` were cut: the params tree's bucket layout, its flat shard plan and
    the mesh axis. Compared and hashed by the shard plan's fingerprint, the leaf order, the tree
    structure and the axis (computed once: JAX compares it on every call of a jitted step)."""

    layout: _Layout
    shards: FlatShardPlan
    axis_name: str
    _key: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        key = (self.shards.fingerprint(), self.layout.leaf_of_spec, self.layout.treedef, self.axis_name)
        object.__setattr__(self, "_key", key)

    def __eq__(self, other):
        return isinstance(other, ShardLayout) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return (f"ShardLayout(plan {self.shards.fingerprint()!r}: {self.shards.bucket_plan.num_buckets} bucket(s) "
                f"cut for axis {self.axis_name!r} of size {self.shards.world_size})")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buckets"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class ParamShards:
    """ZeRO-3 parameters: ``buckets[b]`` is a 1-D array, this device's slice of bucket ``b``.

    Inside ``shard_map`` each bucket has ``layout.shards.shard_sizes[b]`` elements; outside, as
    the global array ``shard_map`` returns with ``out_specs=P(axis)``, it is the whole padded
    bucket, laid out over the devices (what :func:`unshard_params` and the checkpoints read).
    ``layout`` is static: part of the tree structure.
    """

    buckets: tuple
    layout: ShardLayout


def local_slices(layout: _Layout, shards: FlatShardPlan, tree, rank, cuda: bool) -> tuple:
    """This device's slice of every bucket of a replicated tree: no communication."""
    arrays = layout.spec_arrays(tree)
    out = []
    for b in range(layout.plan.num_buckets):
        flat = pack_bucket(layout.plan, b, arrays, length=shards.padded_length(b), cuda=cuda)
        size = shards.shard_sizes[b]
        out.append(jax.lax.dynamic_slice_in_dim(flat, rank * size, size))
    return tuple(out)


def shard_params(params, axis_name, *, bucket_cap_bytes: int | None = None, first_bucket_cap_bytes: int | None = None,
                 order=None, pairing: ParamPairing | None = None, plan: BucketPlan | None = None,
                 copy_backend: str | None = None, mesh=None) -> ParamShards:
    """This device's flat slice of every bucket of ``params`` (replicated), for ZeRO stage 3.

    Run where ``axis_name`` is bound (``jax.shard_map`` with ``in_specs=P()`` for the params and
    ``out_specs=P(axis_name)``, or ``jax.pmap``). The buckets are :func:`hybrid.core.zero3_plan`'s,
    the plan of ``hybrid.torch.ZeRO3``: the tensors in reverse registration order (``order``, or
    torch's names and layouts through ``pairing``, as at stages 1 and 2), capped at
    ``bucket_cap_bytes`` (default :func:`hybrid.core.zero3_bucket_cap`, as ZeRO3's
    ``bucket_cap_mb=None``) and ``first_bucket_cap_bytes`` (default ``min(1 MiB, cap)``); or
    ``plan``, cut as it is. Each bucket is cut by ``shard_flat``: the layout of ZeRO-2's gradient
    slices and of checkpoint files. With ``mesh`` (a plain ``jax.jit``, ``zero(..., mesh=mesh)``)
    it returns the global ParamShards instead, each bucket sharded ``P(axis_name)`` over ``mesh``.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> cut = jax.shard_map(lambda p: shard_params(p, "dp"), mesh=mesh, in_specs=P(), out_specs=P("dp"))
    >>> shards = cut({"w": jnp.arange(3.0)})
    >>> shards.buckets[0].tolist()  # the padded bucket: 2 slices of 2
    [0.0, 1.0, 2.0, 0.0]
    >>> global_shards = shard_params({"w": jnp.arange(3.0)}, "dp", mesh=mesh)  # for a plain jit
    >>> [s.data.tolist() for s in global_shards.buckets[0].addressable_shards]
    [[0.0, 1.0], [2.0, 0.0]]
    """
    check_caps(bucket_cap_bytes, first_bucket_cap_bytes, none_ok=True)
    check_backend(copy_backend)
    if not isinstance(axis_name, str):
        raise TypeError(f"shard_params: axis_name must be one mesh axis name (a str), got {axis_name!r}")
    n = axis_size(axis_name, "shard_params") if mesh is None else check_mesh(mesh, axis_name, "shard_params")
    layout = _Layout.zero3(params, what="shard_params", order=order, pairing=pairing, plan=plan,
                           bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)
    shards = layout.shards(n)
    if mesh is not None:  # the global buckets, each P(axis_name), for a plain jit
        return ParamShards(global_buckets(layout, shards, params, NamedSharding(mesh, P(axis_name))),
                           ShardLayout(layout, shards, axis_name))
    rank = jax.lax.axis_index(axis_name)
    return ParamShards(local_slices(layout, shards, params, rank, use_kernels(copy_backend)),
                       ShardLayout(layout, shards, axis_name))


def refuse_nnx_state(tree, what: str, axis_name, *, mesh: bool = False) -> None:
    """Raise where stage 3 is handed a flax NNX ``nnx.State`` of whole parameters, the one
    ``nnx.Optimizer(model, zero(..., stage=3), wrt=nnx.Param)`` builds its state from, saying why
    it cannot work and what does (:class:`hybrid.jax.ShardedModule`, the functional step)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(tree, nnx.State):
        return
    raise TypeError(
        f"{what}: got an nnx.State of the model's whole parameters (as nnx.Optimizer(model, zero(..., "
        f"stage=3), wrt=nnx.Param) gives it). nnx.Optimizer cannot step a plain NNX model at ZeRO stage 3: "
        f"it steps the module's own nnx.Params, the whole arrays its layers compute with on every device, "
        f"and writes them back into it, where stage 3 keeps only each device's flat slice of the plan's "
        f"buckets (ParamShards) and gathers them where they are used. "
        + ("Wrap the model: sharded = hybrid.jax.ShardedModule(model, "
           f"{axis_name!r}, mesh=mesh) holds its Params as ParamShards and gathers them in its forward; "
           "nnx.Optimizer(sharded, zero(..., stage=3, mesh=mesh), wrt=nnx.Param) and "
           "optimizer.update(sharded, nnx.grad(loss)(sharded, ...)) then work. Or s" if mesh else
           "Under a plain nnx.jit (zero(..., stage=3, mesh=mesh)) hybrid.jax.ShardedModule(model, axis, "
           "mesh=mesh) holds them so for nnx.Optimizer. Or s")
        + f"tep the functional way: graphdef, params = nnx.split(model, nnx.Param); shards = "
        f"hybrid.jax.shard_params(params, {axis_name!r}{', mesh=mesh' if mesh else ''}) (or "
        f"hybrid.jax.init_shards); loss = hybrid.jax.gathered(lambda p, *batch: loss_fn(nnx.merge(graphdef, "
        f"p), *batch)); tx.update(jax.grad(loss)(shards, *batch), state, shards); the trained module is "
        f"nnx.merge(graphdef, hybrid.jax.unshard_params(shards)) (docs/jax-zero.md, 'ZeRO-3 with flax NNX')")


def check_local(shards, what: str, axis_name=None) -> ParamShards:
    """``shards`` if they are this device's ParamShards (for ``axis_name``, default their own) as
    bound here, else an error that names what differs."""
    if not isinstance(shards, ParamShards):
        refuse_nnx_state(shards, what, axis_name if axis_name is not None else "dp")
        raise TypeError(f"{what}: expected the ParamShards of hybrid.jax.shard_params (ZeRO stage 3 keeps "
                        f"parameters as flat slices), got {type(shards).__name__}")
    lay = shards.layout
    if axis_name is not None and axis_name != lay.axis_name:
        raise ValueError(f"{what}: the shards were cut over axis {lay.axis_name!r}, here the axis is "
                         f"{axis_name!r}; give shard_params and zero the same axis name")
    n = axis_size(lay.axis_name, what)
    if n != lay.shards.world_size:
        raise ValueError(f"{what}: the shards were cut for {lay.shards.world_size} device(s) over "
                         f"{lay.axis_name!r}, but the axis has {n} here; to change the device count, go "
                         f"through a checkpoint (hybrid.checkpoint.jax.save / load reshard)")
    for b, (x, size) in enumerate(zip(shards.buckets, lay.shards.shard_sizes)):
        if tuple(x.shape) != (size,):
            raise ValueError(f"{what}: bucket {b} holds {tuple(x.shape)} elements here, but one device's "
                             f"slice of it is ({size},): pass the shards into shard_map with "
                             f"in_specs=P({lay.axis_name!r}) (P() hands every device the whole padded bucket)")
    return shards


def gather_params(shards: ParamShards):
    """The full params tree from this device's slices: one all-gather per bucket, in forward order.

    Call it inside the loss, inside ``shard_map`` (or ``pmap``), or under a plain ``jax.jit`` on the
    global shards of ``shard_params(..., mesh=mesh)`` / ``init_shards`` (a ``P()`` constraint per
    bucket, XLA's all-gather; ``hybrid.jax.sharded._global``). Its transpose, what ``jax.grad``
    runs in the backward, is one reduce-scatter per bucket: the gradient with respect to the
    shards is this device's slice of the bucket's gradient summed over the axis (ZeRO's gradient
    sharding; ``zero(..., stage=3)`` divides by the axis size for the mean). The gathers are issued
    in ``hybrid.core.forward_order``; when each runs, and how long its result lives, is XLA's
    scheduling. Each bucket is unpacked by one split (differentiable; the copy kernels are not used
    here), whose transpose packs the gradients with one concatenate.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> def grad_of_sum(params):
    ...     shards = shard_params(params, "dp")
    ...     return jax.grad(lambda s: jnp.sum(gather_params(s)["w"]))(shards)
    >>> g = jax.shard_map(grad_of_sum, mesh=mesh, in_specs=P(), out_specs=P("dp"))({"w": jnp.ones(3)})
    >>> g.buckets[0].tolist()  # summed over 2 devices; the padding gets no gradient
    [2.0, 2.0, 2.0, 0.0]
    """
    if isinstance(shards, ParamShards):
        mesh = mesh_of(shards)
        if mesh is not None:  # global shards under a plain jit, outside shard_map (zero(..., mesh=mesh))
            return gather_global(shards, mesh)
    lay = check_local(shards, "gather_params").layout
    plan = lay.layout.plan
    per_spec = {}
    for b in forward_order(plan):
        shard = shards.buckets[b]
        # A bucket of zero-size leaves is its own (empty) full bucket: XLA cannot lower a
        # collective over zero elements.
        full = shard if shard.shape[0] == 0 else jax.lax.all_gather(shard, lay.axis_name, axis=0, tiled=True)
        # One split, not a slice per member: its transpose is one concatenate of the cotangents,
        # where slices transpose to a bucket-sized pad per member, all added (python -m hybrid
        # bench jax, 32 members per bucket: CPU time per step 5.5x stage 2's with slices, under 2x
        # with the split; see docs/jax-zero.md).
        pieces = bucket_pieces(plan, b, length=full.shape[0])
        for (m, _), part in zip(pieces, split_bucket(full, [n for _, n in pieces], lay.axis_name)):
            if m is not None:
                per_spec[m] = part.reshape(plan.specs[m].shape)
    return lay.layout.unflatten(per_spec)


# Recomputed in the backward rather than saved: all-gathers, and data movement (whose recompute is
# a copy), so that a gathered parameter is never kept for the backward under another shape or dtype.
_REGATHERED = frozenset({"all_gather", "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim",
                         "convert_element_type", "slice", "dynamic_slice", "split", "concatenate", "copy", "copy_p",
                         "sharding_constraint"})  # the all-gather of global shards under a plain jit


def regather_policy(prim, *args, **params) -> bool:
    """A ``jax.checkpoint`` policy: save every intermediate except all-gathered values and data
    movement, so the backward gathers the parameters again (FSDP's ``reshard_after_forward``)."""
    del args, params
    return prim.name not in _REGATHERED


def gathered(fun, *, argnums: int = 0, reshard_after_forward: bool = True):
    """``fun`` of a params tree as a function of :class:`ParamShards` at ``argnums``, which are
    gathered (:func:`gather_params`) before ``fun`` runs.

    With ``reshard_after_forward`` (the default, as FSDP's) the result is ``jax.checkpoint``-ed
    with :func:`regather_policy`: activations are saved as usual, but no gathered parameter is, so
    the backward all-gathers again each bucket whose parameters it reads (a matmul's weight: with
    the forward's gather and the reduce-scatter, 1.5x DDP's volume). ``False`` keeps the forward's
    gathered parameters for the backward (DDP's volume; every bucket held from its forward use to
    its backward). Either way XLA has the last word: a compiler that merges the two identical
    gathers keeps the parameters, as XLA:CPU does (see docs/jax-zero.md, "ZeRO-3"); there, unless
    ``XLA_FLAGS`` disables its ``cse`` pass, no checkpoint is made (it would only split each bucket
    twice: ``hybrid.jax.sharded._xla_flags``).

    Given global ParamShards outside ``shard_map`` (a plain ``jax.jit``, ``zero(..., mesh=mesh)``)
    it runs ``fun`` per device in a ``shard_map`` of its own: every other positional array split
    over the axis on its first dimension (the batch), the outputs averaged over the axis, so a loss
    that is a mean over an evenly split batch keeps its value and ``jax.grad`` reduce-scatters.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> loss = lambda params, x: jnp.sum(jnp.tanh(x @ params["w"]))
    >>> def grad(params, x):
    ...     return jax.grad(gathered(loss))(shard_params(params, "dp"), x)
    >>> g = jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"))({"w": jnp.ones((2, 1))},
    ...                                                                                 jnp.ones((4, 2)))
    >>> [round(float(v), 4) for v in g.buckets[0]]
    [0.2826, 0.2826]
    """
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        raise TypeError(f"gathered: argnums must be one int (the position of the ParamShards), got {argnums!r}")

    @functools.wraps(fun)
    def on_shards(*args, **kwargs):
        if not -len(args) <= argnums < len(args):
            raise TypeError(f"gathered: argnums={argnums}, but {len(args)} positional argument(s) were given")
        args = list(args)
        args[argnums] = gather_params(args[argnums])
        return fun(*args, **kwargs)

    regathered = jax.checkpoint(on_shards, policy=regather_policy) if reshard_after_forward else on_shards

    def local(*args, **kwargs):
        # Where XLA would merge the backward's gathers with the forward's (XLA:CPU's CSE), asking
        # for them only recomputes the split: the gathered parameters twice (see _xla_flags).
        return (on_shards if cse_merges_regathers() else regathered)(*args, **kwargs)

    @functools.wraps(fun)
    def loss_of_shards(*args, **kwargs):
        shards = args[argnums] if -len(args) <= argnums < len(args) else None
        mesh = mesh_of(shards) if isinstance(shards, ParamShards) else None
        if mesh is None:  # inside shard_map / pmap: this device's slices
            return local(*args, **kwargs)
        # global shards under a plain jit: per device inside shard_map, so that jax.grad's
        # transpose of the gathers is a reduce-scatter (hybrid.jax.sharded._global)
        return per_device_mean(local, args, kwargs, argnums % len(args), mesh, shards.layout.axis_name)

    return loss_of_shards


def unshard_params(shards: ParamShards):
    """The params tree from global :class:`ParamShards` (outside ``shard_map``: each bucket the
    whole padded array), e.g. to evaluate or export after training. Works on host arrays too.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> cut = jax.shard_map(lambda p: shard_params(p, "dp"), mesh=mesh, in_specs=P(), out_specs=P("dp"))
    >>> unshard_params(cut({"w": jnp.arange(3.0)}))["w"].tolist()
    [0.0, 1.0, 2.0]
    """
    if not isinstance(shards, ParamShards):
        raise TypeError(f"unshard_params: expected ParamShards, got {type(shards).__name__}")
    lay = shards.layout
    per_spec = {}
    for b, flat in enumerate(shards.buckets):
        if tuple(np.shape(flat)) != (lay.shards.padded_length(b),):
            raise ValueError(f"unshard_params: bucket {b} has shape {tuple(np.shape(flat))}, the whole padded "
                             f"bucket is ({lay.shards.padded_length(b)},): pass the global shards (outside "
                             f"shard_map); inside it, use hybrid.jax.gather_params")
        per_spec.update(unpack(lay.layout.plan, b, flat))
    return lay.layout.unflatten(per_spec)
