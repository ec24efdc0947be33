"""flax NNX at ZeRO stage 3 with ``nnx.Optimizer``: :class:`ShardedModule`.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` steps the module's own ``nnx.Param``s and writes the
result back into it. A plain NNX model holds its parameters whole on every device, which is what
stage 3 does not keep, so ``zero(..., stage=3)`` refuses its State (``_params.refuse_nnx_state``).
A ``ShardedModule`` is an NNX module whose one ``nnx.Param`` holds the model's parameters as
global :class:`~hybrid.jax.ParamShards` (``P(axis)``: each device its flat slice of every bucket),
and whose forward runs the model per device inside a ``shard_map`` of its own: the shards gathered
there (one all-gather per bucket; ``jax.grad``'s transpose, one reduce-scatter per bucket), every
positional array argument split over the axis on its first dimension (the batch), the outputs
put back together over it. The loss is computed from those outputs outside, under the user's
jit, as with any module; ``nnx.grad`` of it gives the gradient as ParamShards inside the same
kind of State, which ``zero(..., stage=3, mesh=mesh)`` takes and gives back updates for.

flax is imported here, at the module's import: ``hybrid.jax`` imports this module only when
``hybrid.jax.ShardedModule`` is first asked for (hybrid never imports flax otherwise).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from hybrid.jax.sharded._global import batch_specs, check_mesh
from hybrid.jax.sharded._init import init_shards
from hybrid.jax.sharded._params import ParamShards, gathered, shard_params, unshard_params


class ShardedModule(nnx.Module):
    """``model``'s ``nnx.Param``s as ZeRO-3 :class:`~hybrid.jax.ParamShards` over ``mesh``'s
    ``axis_name``, in a module that ``nnx.Optimizer(sharded, zero(chain, axis_name, stage=3,
    mesh=mesh), wrt=nnx.Param)`` steps like any other.

    Calling it runs ``model`` per device: the shards all-gathered per bucket (and again in the
    backward with ``reshard_after_forward``, as :func:`hybrid.jax.gathered`), every positional
    array argument split over ``axis_name`` on its first dimension (the batch: its size a multiple
    of the axis size), scalars replicated, and each output put back together on its first
    dimension. So a loss computed from its outputs under a plain ``nnx.jit`` has the value it has on
    the whole model, and ``nnx.grad`` of it reduce-scatters the gradient into the shards.

    Args:
      model: an NNX module whose only variables are ``nnx.Param``s (a forward that updates other
        variables, batch statistics or dropout RNG counts, cannot write them back from inside the
        per-device ``shard_map``: refused); or a function of no arguments that makes one, which is
        then born sharded (:func:`hybrid.jax.init_shards`: each device computes its share of the
        init, no device holds the whole model).
      axis_name: the mesh axis the shards and the batch are split over.
      mesh: the ``jax.sharding.Mesh``.
      reshard_after_forward: gather the parameters again in the backward (FSDP's default) rather
        than keep the forward's.
      plan_options: for :func:`hybrid.jax.shard_params` (``bucket_cap_bytes``,
        ``first_bucket_cap_bytes``, ``order``, ``pairing``, ``plan``).

    ``sharded.shards.get_value()`` is the ParamShards (what ``hybrid.checkpoint.jax.save`` takes at
    stage 3); ``sharded.unsharded()`` the whole model again, outside jit.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from flax import nnx
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> sharded = ShardedModule(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "dp", mesh=mesh)
    >>> [x.shape for x in sharded.shards.get_value().buckets]  # kernel and bias in one padded bucket
    [(8,)]
    >>> bool(jnp.allclose(sharded(jnp.ones((4, 3))), sharded.unsharded()(jnp.ones((4, 3)))))
    True
    """

    def __init__(self, model: nnx.Module, axis_name: str, *, mesh, reshard_after_forward: bool = True,
                 **plan_options):
        check_mesh(mesh, axis_name, "ShardedModule")
        make = None if isinstance(model, nnx.Module) else model
        if make is not None:
            if not callable(make):
                raise TypeError(f"ShardedModule: model must be an nnx.Module or a function making one, got "
                                f"{type(model).__name__}")
            model = nnx.eval_shape(make)  # shapes only: the graph and what it holds
        other = nnx.state(model, nnx.Not(nnx.Param))
        if jax.tree.leaves(other):
            names = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(other)]
            raise ValueError(f"ShardedModule: the model holds variables other than nnx.Param ({names[:4]}"
                             f"{' ...' if len(names) > 4 else ''}): stage 3 shards the Params, and a forward run "
                             f"per device inside its own shard_map cannot write other variables (batch "
                             f"statistics, RNG counts) back; it takes models whose only variables are Params")
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.axis_name, self.mesh, self.reshard_after_forward = axis_name, mesh, reshard_after_forward
        self.shards = nnx.Param(shard_params(params, axis_name, mesh=mesh, **plan_options) if make is None else
                                init_shards(lambda: nnx.split(make(), nnx.Param)[1], mesh=mesh, axis_name=axis_name,
                                            **plan_options))

    def __call__(self, *args):
        axis = self.axis_name
        shards = self.shards.get_value()
        if not isinstance(shards, ParamShards):
            raise TypeError(f"ShardedModule: its Param holds {type(shards).__name__}, not the ParamShards it was "
                            f"built with")
        specs = batch_specs(args, axis, self.mesh.shape[axis], "ShardedModule")
        graphdef = self.graphdef
        forward = gathered(lambda params, *a: nnx.merge(graphdef, params)(*a),
                           reshard_after_forward=self.reshard_after_forward)
        return jax.shard_map(forward, mesh=self.mesh, in_specs=(P(axis), *specs), out_specs=P(axis))(shards, *args)

    def unsharded(self) -> nnx.Module:
        """The whole model from the shards (outside jit: to evaluate or export)."""
        return nnx.merge(self.graphdef, unshard_params(self.shards.get_value()))
