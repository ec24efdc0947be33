"""ZeRO stage 3: the inner optax transform steps this device's parameter slices with the gradient
slices ``jax.grad`` returns through :func:`hybrid.jax.gather_params`. No collective of its own.

What stage 3 moves out of the transform: the reduce-scatter of the gradients is the backward of
``gather_params`` (in the user's ``jax.grad``), and the all-gather of the updated parameters is
the next forward's ``gather_params``. ``update`` divides by the axis size (``mean``) and runs the
inner transform on the slices exactly as stages 1 and 2 do, so the states are the same
:class:`~hybrid.jax.ZeroState`, with the same fingerprint: a stage-3 state is a stage-2 state.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from hybrid.jax.sharded._on_shards import on_shards
from hybrid.jax.sharded._params import ParamShards, check_local
from hybrid.jax._specs import axis_size, check_state_per_device
from hybrid.jax.sharded._slices import ZeroState, check_inner, on_slices, zero_state


def _abstract_params(shards: ParamShards):
    """The params tree as shapes and dtypes: what a callable mask or label function is given at
    stage 3, where no device holds the tree (optax calls them with params or updates)."""
    return shards.layout.layout.abstract()


def zero3(inner: optax.GradientTransformation, axis_name, *, mean: bool,
          check_elementwise: bool) -> optax.GradientTransformation:
    """``hybrid.jax.zero(inner, axis_name, stage=3)``: see its docstring and docs/jax-zero.md."""
    check_inner(inner, axis_name, check_elementwise)
    flat_inner = on_slices(inner)

    def bound(shards: ParamShards, rank):
        lay = shards.layout
        return flat_inner(_abstract_params(shards), lay.layout, lay.shards, rank)

    def init_fn(params):
        shards = check_local(params, "zero.init (stage 3)", axis_name)
        rank = jax.lax.axis_index(axis_name)
        with on_shards(axis_name):
            inner_state = bound(shards, rank).init(shards.buckets)
        return zero_state(inner_state, shards.layout.shards)

    def update_fn(updates, state, params=None):
        if not isinstance(state, ZeroState):
            raise TypeError(f"zero.update: state must be the ZeroState from zero.init, got {type(state).__name__}")
        grads = check_local(updates, "zero.update (stage 3) updates", axis_name)
        if grads.layout.shards.fingerprint() != state.plan_fingerprint:
            raise ValueError(f"zero.update (stage 3): the updates' shard plan {grads.layout.shards.fingerprint()} "
                             f"differs from the one zero.init saw ({state.plan_fingerprint!r}): re-run init "
                             f"after changing the model, caps, order or device count")
        check_state_per_device(state, axis_name, "zero.update (stage 3)")
        param_slices = None
        if params is not None:
            if check_local(params, "zero.update (stage 3) params", axis_name).layout != grads.layout:
                raise ValueError(f"zero.update (stage 3): params {params.layout} and updates {grads.layout} "
                                 f"were cut by different plans")
            param_slices = params.buckets
        n = axis_size(axis_name, "zero.update (stage 3)")
        # gather_params' backward summed the gradients over the axis; DDP's mean divides.
        slices = tuple(g / n for g in grads.buckets) if mean else grads.buckets
        with on_shards(axis_name):
            new, inner_state = bound(grads, jax.lax.axis_index(axis_name)).update(slices, state.inner, param_slices)
        return ParamShards(tuple(new), grads.layout), dataclasses.replace(state, inner=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)
