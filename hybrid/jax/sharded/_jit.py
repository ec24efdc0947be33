"""ZeRO stages 1-3 inside the user's own ``jax.jit`` over a ``Mesh``: ``zero(inner, axis, stage=k, mesh=mesh)``.

No ``shard_map``: the step is a plain jitted function, the batch sharded ``P(axis)``, the gradients
plain ``jax.grad`` of the loss over the global batch. The plan is the ``shard_map`` path's (the
same buckets, shards and :class:`~hybrid.jax.ZeroState` fingerprint), but every array is global
and its sharding a ``NamedSharding`` that XLA partitions:

- the gradient leaves (plain ``jax.grad``: XLA reduces them where the dots are, on XLA:CPU one
  combined all-reduce) are cut into the plan's bucket slices, each device copying only its own
  (``hybrid.jax.sharded._global.local_buckets``), as global arrays sharded ``P(axis)``;
- the inner optax transform runs on the global flat buckets, its state constrained to ``P(axis)``
  (each device holds ``1 / N`` of it: a bucket's padded length is a multiple of ``N``);
- the updated bucket is constrained to ``P()`` (one all-gather per bucket) and unpacked;
- at stage 3 the parameters are global :class:`~hybrid.jax.ParamShards` (``P(axis)``), the loss
  takes them through :func:`hybrid.jax.gathered`, which runs it per device (one all-gather per
  bucket, whose transpose under ``jax.grad`` is one reduce-scatter per bucket), and ``update``
  returns updates of the sharded buckets: no collective of its own. A container of exactly one
  ParamShards (the nnx.State of a :class:`hybrid.jax.ShardedModule`, as ``nnx.Optimizer`` hands
  it over) is taken too, the updates given back in the same container.

Inside ``zero`` the inner transform sees whole buckets, so optax's own ``clip_by_global_norm``
(and ``apply_if_finite``) decide over every element, as unsharded; masks and labels are rewritten
per element of the whole bucket (``hybrid.jax.sharded._masks``, ``rank=None``).

Why stages 1-2 all-reduce: a plain ``jax.grad`` of replicated parameters is reduced by XLA's
partitioner at each dot, and XLA:CPU has no pass turning an all-reduce and a slice into a
reduce-scatter (GSPMD's own ZeRO-1 reduces the same way there); a reduce-scatter needs the
gradient per device, which only stage 3's gathered loss has (docs/jax.md, "ZeRO inside a plain
``jax.jit``").
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybrid.core import unpack
from hybrid.jax._elementwise import GLOBAL_DECISIONS, non_elementwise, optax_names
from hybrid.jax._specs import _Layout, check_caps
from hybrid.jax.sharded._global import check_mesh, global_buckets, local_buckets
from hybrid.jax.sharded._axis_aware import axis_aware
from hybrid.jax.sharded._params import ParamShards, refuse_nnx_state
from hybrid.jax.sharded._slices import ZeroState, check_inner, check_plan, on_slices, zero_state

# Exact on whole buckets (they decide over every element), refused on a device's slices.
_WHOLE_ONLY = ("clip_by_global_norm", "apply_if_finite")


def _check_inner_whole(inner, axis_name, check_elementwise: bool) -> None:
    """Refuse what is not exact on flat buckets; allow what decides over all of them at once."""
    if not check_elementwise:
        return
    if optax_names(inner, tuple(GLOBAL_DECISIONS)):  # the probe cannot run a skip decision; walk only
        bad = [n for n in non_elementwise(inner) if n not in _WHOLE_ONLY]
        if bad:
            check_inner(inner, axis_name, True)  # raises, naming them and the fix
        return
    check_inner(axis_aware(inner, axis_name), axis_name, True)


def _on_whole_buckets(bind, axis_name):
    """``(tree, layout, shards) -> transform``: the inner transform on whole buckets (``rank=None``),
    whose errors about an unbound axis (hybrid's axis-aware twins, made for a device's slices, psum
    over the axis) say what to use under a plain jit."""
    def bound(tree, layout, shards):
        tx = bind(tree, layout, shards, None)

        def explained(fn):
            def call(*args):
                try:
                    return fn(*args)
                except ValueError as e:
                    if f"axis name {axis_name!r} is not bound" not in str(e):
                        raise
                    raise ValueError(f"zero(mesh=...): {e}. Under a plain jit zero's inner transform sees whole "
                                     f"buckets, not a device's slices: use optax.clip_by_global_norm and "
                                     f"optax.apply_if_finite there, not hybrid.jax's axis-aware twins") from None
            return call
        return optax.GradientTransformation(explained(tx.init), explained(tx.update))
    return bound


def _shard_state(tree, sharded, replicated, n: int):
    """Constrain a state tree: bucket-long arrays over the axis (``1 / N`` per device), the rest
    (step counts, scalars) replicated."""
    def one(x):
        if getattr(x, "ndim", 0) >= 1 and x.shape[0] > 0 and x.shape[0] % n == 0:
            return jax.lax.with_sharding_constraint(x, sharded)
        return jax.lax.with_sharding_constraint(x, replicated) if hasattr(x, "ndim") else x
    return jax.tree.map(one, tree)


def zero_jit(inner: optax.GradientTransformation, axis_name: str, mesh: Mesh, *, stage: int, mean: bool,
             check_elementwise: bool, plan_options: dict) -> optax.GradientTransformation:
    """``hybrid.jax.zero(inner, axis_name, stage=stage, mesh=mesh)``: see its docstring and this module's."""
    n = check_mesh(mesh, axis_name, "zero(mesh=...)")
    if not mean:
        raise ValueError("zero(mesh=...): mean=False has no effect under jit: the gradient is jax.grad of your "
                         "loss over the global batch, already the loss's own reduction (scale the loss to sum)")
    if plan_options.get("copy_backend") not in (None, "reference"):
        raise ValueError(f"zero(mesh=...): copy_backend={plan_options['copy_backend']!r}: under jit XLA partitions "
                         f"the packing itself; the copy kernels run inside shard_map only")
    _check_inner_whole(inner, axis_name, check_elementwise)
    sharded, replicated = NamedSharding(mesh, P(axis_name)), NamedSharding(mesh, P())
    flat_inner = _on_whole_buckets(on_slices(inner), axis_name)  # masks and labels per element of the whole bucket
    if stage == 3:
        return _zero3_jit(flat_inner, axis_name, n, sharded, replicated)
    caps = {k: plan_options[k] for k in ("bucket_cap_bytes", "first_bucket_cap_bytes")}
    check_caps(**caps)

    def layout_of(tree, what):
        return _Layout.of(tree, what=what, order=plan_options["order"], ready_order=plan_options["ready_order"],
                          pairing=plan_options["pairing"], plan=plan_options["plan"], **caps)

    def init_fn(params):
        layout = layout_of(params, "zero.init")
        shards = layout.shards(n)
        flats = global_buckets(layout, shards, params, sharded)
        state = flat_inner(params, layout, shards).init(flats)
        return zero_state(_shard_state(state, sharded, replicated, n), shards)

    def update_fn(updates, state, params=None):
        layout = layout_of(updates, "zero.update")
        shards = layout.shards(n)
        check_plan(state, shards)
        if params is None:
            [grads], param_flats = local_buckets(layout, shards, [updates], mesh, axis_name), None
        else:
            if layout_of(params, "zero.update params").plan != layout.plan:
                raise ValueError("zero.update: params and updates must be trees of the same names, shapes and dtypes")
            grads, param_flats = local_buckets(layout, shards, [updates, params], mesh, axis_name)
        new, inner_state = flat_inner(updates, layout, shards).update(grads, state.inner, param_flats)
        out = {}
        for b, flat in enumerate(new):
            out.update(unpack(layout.plan, b, jax.lax.with_sharding_constraint(flat, replicated)))  # all-gather
        return layout.unflatten(out), dataclasses.replace(state, inner=_shard_state(inner_state, sharded,
                                                                                         replicated, n))

    return optax.GradientTransformation(init_fn, update_fn)


def _check_global(shards, what: str, axis_name: str, n: int) -> ParamShards:
    if not isinstance(shards, ParamShards):
        refuse_nnx_state(shards, what, axis_name, mesh=True)
        raise TypeError(f"{what}: expected the global ParamShards of hybrid.jax.shard_params(params, "
                        f"{axis_name!r}, mesh=mesh) or hybrid.jax.init_shards (ZeRO stage 3 keeps parameters as "
                        f"flat slices), got {type(shards).__name__}")
    lay = shards.layout
    if lay.axis_name != axis_name or lay.shards.world_size != n:
        raise ValueError(f"{what}: the shards were cut for {lay.shards.world_size} device(s) over "
                         f"{lay.axis_name!r}, the mesh axis is {axis_name!r} of {n}")
    for b, x in enumerate(shards.buckets):
        if tuple(x.shape) != (lay.shards.padded_length(b),):
            raise ValueError(f"{what}: bucket {b} has shape {tuple(x.shape)}, the whole padded bucket is "
                             f"({lay.shards.padded_length(b)},): under jit pass the global ParamShards")
    return shards


def _held(tree):
    """``(the ParamShards, put back)`` where ``tree`` is a container of exactly one ParamShards (the
    nnx.State of a :class:`hybrid.jax.ShardedModule`, as ``nnx.Optimizer`` passes it), else
    ``(tree, identity)``."""
    if isinstance(tree, ParamShards):
        return tree, lambda shards: shards
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, ParamShards))
    if len(leaves) == 1 and isinstance(leaves[0], ParamShards):
        return leaves[0], lambda shards: jax.tree.unflatten(treedef, [shards])
    return tree, lambda shards: shards


def _zero3_jit(flat_inner, axis_name: str, n: int, sharded, replicated) -> optax.GradientTransformation:
    def bound(shards: ParamShards):
        lay = shards.layout
        return flat_inner(lay.layout.abstract(), lay.layout, lay.shards)

    def init_fn(params):
        shards = _check_global(_held(params)[0], "zero.init (stage 3)", axis_name, n)
        buckets = tuple(jax.lax.with_sharding_constraint(x, sharded) for x in shards.buckets)
        state = bound(shards).init(buckets)
        return zero_state(_shard_state(state, sharded, replicated, n), shards.layout.shards)

    def update_fn(updates, state, params=None):
        if not isinstance(state, ZeroState):
            raise TypeError(f"zero.update: state must be the ZeroState from zero.init, got {type(state).__name__}")
        updates, put_back = _held(updates)
        grads = _check_global(updates, "zero.update (stage 3) updates", axis_name, n)
        if grads.layout.shards.fingerprint() != state.plan_fingerprint:
            raise ValueError(f"zero.update (stage 3): the updates' shard plan {grads.layout.shards.fingerprint()} "
                             f"differs from the one zero.init saw ({state.plan_fingerprint!r}): re-run init")
        param_buckets = None
        if params is not None:
            params = _held(params)[0]
            if _check_global(params, "zero.update (stage 3) params", axis_name, n).layout != grads.layout:
                raise ValueError(f"zero.update (stage 3): params {params.layout} and updates {grads.layout} "
                                 f"were cut by different plans")
            param_buckets = tuple(jax.lax.with_sharding_constraint(x, sharded) for x in params.buckets)
        buckets = tuple(jax.lax.with_sharding_constraint(x, sharded) for x in grads.buckets)
        new, inner_state = bound(grads).update(buckets, state.inner, param_buckets)
        new = tuple(jax.lax.with_sharding_constraint(x, sharded) for x in new)
        return put_back(ParamShards(new, grads.layout)), dataclasses.replace(
            state, inner=_shard_state(inner_state, sharded, replicated, n))

    return optax.GradientTransformation(init_fn, update_fn)
