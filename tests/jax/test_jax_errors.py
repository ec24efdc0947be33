"""Errors that say what was seen: gradients reduced twice, state specs for another axis size or P()."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from _jax_model import CAPS, loss, make_batch, make_params

MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))


def _transform(name):
    return {"zero": hj.zero(optax.adam(1e-2), "dp", **CAPS),
            "bucketed_all_reduce": optax.chain(hj.bucketed_all_reduce("dp", **CAPS), optax.adam(1e-2))}[name]


@pytest.mark.parametrize("name", ["zero", "bucketed_all_reduce"])
def test_local_grad_then_pmean_names_both_causes(name):
    # The user took local_grad and averaged it themselves: before, the error blamed jax.grad.
    tx = _transform(name)
    specs = hj.state_specs(tx, make_params(), "dp", axis_size=4)

    def step(params, state, x, y):
        g = jax.lax.pmean(hj.local_grad(loss, "dp")(params, x, y), "dp")
        return tx.update(g, state, params)[1]

    with pytest.raises(ValueError) as e:
        jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=specs))(
            make_params(), jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(make_params()),
            *make_batch(0))
    text = str(e.value)
    assert "already identical on every device, so it was reduced before" in text
    assert "jax.grad of replicated (P()) parameters" in text and "hybrid.jax.local_grad" in text
    assert "lax.pmean / lax.psum" in text and "drop that reduction" in text


def test_state_specs_for_another_axis_size_names_both():
    tx = _transform("zero")
    specs = hj.state_specs(tx, make_params(), "dp", axis_size=2)  # the mesh has 4 devices
    with pytest.raises(ValueError) as e:
        jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(make_params())
    text = str(e.value)  # JAX's own pytree error; the fingerprints' reprs say what they are
    assert "zero's shard plan" in text and "cut for axis_size=2" in text and "cut for axis_size=4" in text


@pytest.mark.parametrize("name,leaf", [("zero", "inner.0.mu.0"), ("bucketed_all_reduce", "buckets.0")])
def test_replicated_state_spec_names_the_leaf(name, leaf):
    # Before: JAX's "could not infer replication" at the step's out_specs, naming no leaf.
    tx = _transform(name)
    specs = hj.state_specs(tx, make_params(), "dp", axis_size=4)
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(make_params())
    replicated = jax.tree_util.tree_map(lambda _: P(), specs)
    state = jax.tree_util.tree_map(lambda x: x[: x.shape[0] // 4] if x.ndim else x, state)  # one device's part

    def step(params, state, x, y):
        return tx.update(hj.local_grad(loss, "dp")(params, x, y), state, params)[1]

    with pytest.raises(ValueError, match=rf"state leaf '{leaf}' is replicated over 'dp' \(a P\(\) spec\).*"
                                         rf"hybrid.jax.state_specs"):
        jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P(), replicated, P("dp"), P("dp")),
                              out_specs=replicated))(make_params(), state, *make_batch(0))
