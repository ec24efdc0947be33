"""Per-device gradients inside shard_map, where jax.grad would sum them over the axis."""

from __future__ import annotations

import sys

import jax

from hybrid.jax._specs import varying_axes


def local_grad(fun, axis_name, *, argnums: int = 0, has_aux: bool = False):
    """``jax.grad(fun)`` that returns this device's gradient, not the sum over ``axis_name``.

    Inside ``jax.shard_map`` (with its default ``check_vma=True``) parameters passed with
    ``in_specs=P()`` are *invariant* over the axis; the loss, computed from the device's batch
    shard, *varies*. Differentiating turns the implicit invariant-to-varying cast into a
    ``psum``, so ``jax.grad`` already returns the gradient summed over devices. Feeding that to
    :func:`bucketed_all_reduce` or :func:`zero` (which reduce again, DDP-style) would give
    ``world_size`` times the gradient. ``local_grad`` casts the parameters to varying first
    (``lax.pcast(..., to="varying")``), so the gradient stays per device, as under ``pmap``.
    A flax NNX module at ``argnums`` is differentiated as ``nnx.grad`` does (the gradients an
    ``nnx.State`` of its ``nnx.Param``s, for ``nnx.Optimizer.update``), per device likewise.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    >>> loss = lambda w, x: jnp.sum(w * x)
    >>> f = jax.shard_map(lambda w, x: local_grad(loss, "dp")(w, x), mesh=mesh,
    ...                   in_specs=(P(), P("dp")), out_specs=P("dp"))
    >>> np.asarray(f(jnp.ones(1), jnp.arange(4.0))).tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    grad = jax.grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        args = list(args)
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        if any(_is_nnx_module(args[i]) for i in nums):
            return _nnx_local_grad(fun, axis_name, nums, argnums, has_aux, args, kwargs)
        for i in nums:
            args[i] = jax.tree_util.tree_map(lambda x: _varying(x, axis_name), args[i])
        return grad(*args, **kwargs)

    return wrapped


def _is_nnx_module(x) -> bool:
    nnx = sys.modules.get("flax.nnx")  # hybrid never imports flax; a Module means it is loaded
    return nnx is not None and isinstance(x, nnx.Module)


def _nnx_local_grad(fun, axis_name, nums, argnums, has_aux, args, kwargs):
    """``nnx.grad(fun)`` of per-device copies of the modules at ``nums``: their ``nnx.Param``s cast
    to varying, as for a params tree; the gradients are an ``nnx.State`` of the Params, as
    ``nnx.grad`` returns them. What ``fun`` changes in a module's other variables (batch
    statistics, RNG counts) is written back into the module it was given."""
    from flax import nnx

    copies = {}
    for i in nums:
        if _is_nnx_module(args[i]):
            graphdef, params, rest = nnx.split(args[i], nnx.Param, ...)
            params = jax.tree_util.tree_map(lambda x: _varying(x, axis_name), params)
            copies[i] = args[i]
            args[i] = nnx.merge(graphdef, params, rest)
        else:
            args[i] = jax.tree_util.tree_map(lambda x: _varying(x, axis_name), args[i])
    out = nnx.grad(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
    for i, module in copies.items():
        nnx.update(module, nnx.state(args[i], nnx.Not(nnx.Param)))
    return out


def _varying(x, axis_name):
    if axis_name in varying_axes(x):
        return x
    return jax.lax.pcast(x, axis_name, to="varying")
