"""A ZeRO-3 training loop over the tests' tiny MLP, as users write it (shared by the stage-3 tests)."""

import jax
import optax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np

import hybrid.jax as hj
from tests.jax._jax_model import CAPS, jitted, loss


def mesh_of(n, axis="dp"):
    return Mesh(np.array(jax.devices()[:n]), (axis,))


def cut(params, mesh, **caps):
    """Global ParamShards of a replicated params tree (``shard_params`` under ``shard_map``)."""
    caps = caps or CAPS
    return jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp", **caps), mesh=mesh, in_specs=P(),
                                 out_specs=P("dp")))(params)


def stage3_train(tx, mesh, shards, *, reshard_after_forward=True):
    """``(init, step)``: ``step(shards, state, x, y)`` takes jax.grad of the gathered loss with
    respect to the shards (already reduce-scattered) and steps them with ``tx``."""
    specs = hj.state_specs(tx, shards, "dp", axis_size=mesh.size)
    loss_of_shards = hj.gathered(loss, reshard_after_forward=reshard_after_forward)

    def step(shards, state, x, y):
        g = jax.grad(loss_of_shards)(shards, x, y)
        u, state = tx.update(g, state, shards)
        return optax.apply_updates(shards, u), state

    init = jitted(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))
    step = jitted(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp"), P("dp")),
                                out_specs=(P("dp"), specs)))
    return init, step
