"""Stage-3 misuse names its cause: shards used outside shard_map, over another axis or device count,
under a P() spec, with another plan than init's, or given to the stage-1/2 API."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj
from tests.jax._jax_model import CAPS, loss, make_batch, make_params
from tests.jax.zero3._zero3_run import cut, mesh_of, stage3_train


@pytest.fixture(scope="module")
def shards():
    return cut(make_params(), mesh_of(4))


def _gather_on(mesh, spec, shards):
    return jax.jit(jax.shard_map(lambda s: jax.tree.map(lambda x: x[None], hj.gather_params(s)), mesh=mesh,
                                 in_specs=spec, out_specs=P(*mesh.axis_names)))(shards)


def test_gather_outside_shard_map(shards):
    # Global shards on a mesh gather outside shard_map (the plain-jit path, zero(..., mesh=mesh));
    # shards on no mesh (host arrays) say where gather_params runs.
    for a, b in zip(jax.tree.leaves(hj.gather_params(shards)), jax.tree.leaves(hj.unshard_params(shards))):
        assert (a == b).all()
    with pytest.raises(ValueError, match=r"gather_params: axis name 'dp' is not bound; no axis is bound here; "
                                         r"call it inside jax.shard_map"):
        hj.gather_params(jax.tree.map(np.asarray, shards))


def test_gather_on_a_mesh_axis_of_another_name(shards):
    with pytest.raises(ValueError, match=r"axis name 'dp' is not bound; the axes bound here are \['data'\]"):
        _gather_on(mesh_of(4, "data"), P("data"), shards)


def test_zero_over_another_axis_than_the_shards():
    mesh = mesh_of(4, "data")
    shards = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "data", **CAPS), mesh=mesh, in_specs=P(),
                                   out_specs=P("data")))(make_params())
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    with pytest.raises(ValueError, match=r"zero.init \(stage 3\): the shards were cut over axis 'data', here the "
                                         r"axis is 'dp'"):
        jax.vmap(tx.init, axis_name="dp", axis_size=4, in_axes=None)(hj.ParamShards(
            tuple(jax.ShapeDtypeStruct((size,), jnp.float32) for size in shards.layout.shards.shard_sizes),
            shards.layout))


def test_shards_of_another_device_count(shards):
    with pytest.raises(ValueError, match=r"cut for 4 device\(s\) over 'dp', but the axis has 2 here; to change "
                                         r"the device count, go through a checkpoint"):
        _gather_on(mesh_of(2), P("dp"), shards)


def test_shards_under_a_replicated_spec(shards):
    with pytest.raises(ValueError, match=r"bucket 0 holds \(8,\) elements here, but one device's slice of it is "
                                         r"\(2,\): pass the shards into shard_map with in_specs=P\('dp'\)"):
        _gather_on(mesh_of(4), P(), shards)


def test_update_with_shards_of_another_plan(shards):
    # init saw the shards cut with the tests' caps; the gradients come from shards of the default caps.
    mesh = mesh_of(4)
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    init, _ = stage3_train(tx, mesh, shards)
    state = init(shards)
    other = cut(make_params(), mesh, bucket_cap_bytes=1 << 20, first_bucket_cap_bytes=1 << 20)
    specs = hj.state_specs(tx, shards, "dp", axis_size=4)

    def step(other, state, x, y):
        return tx.update(jax.grad(hj.gathered(loss))(other, x, y), state, other)[1]

    with pytest.raises(ValueError, match=r"zero.update \(stage 3\): the updates' shard plan \w+ differs from the "
                                         r"one zero.init saw .* re-run init"):
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp"), P("dp")), out_specs=specs))(
            other, state, *make_batch(0))


def test_stage3_given_a_params_tree():
    mesh = mesh_of(4)
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    with pytest.raises(TypeError, match=r"zero.init \(stage 3\): expected the ParamShards of "
                                        r"hybrid.jax.shard_params .* got dict"):
        jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()))(make_params())


def test_stage3_refuses_plan_arguments_it_would_ignore():
    with pytest.raises(ValueError, match=r"zero\(stage=3\): \['bucket_cap_bytes', 'order'\] would have no effect.*"
                                         r"pass them to hybrid.jax.shard_params"):
        hj.zero(optax.adam(1e-2), "dp", stage=3, bucket_cap_bytes=40, order=["a"])
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got 4"):
        hj.zero(optax.adam(1e-2), "dp", stage=4)


def test_unshard_inside_shard_map(shards):
    with pytest.raises(ValueError, match=r"unshard_params: bucket 0 has shape \(2,\), the whole padded bucket is "
                                         r"\(8,\): pass the global shards \(outside shard_map\); inside it, use "
                                         r"hybrid.jax.gather_params"):
        jax.jit(jax.shard_map(hj.unshard_params, mesh=mesh_of(4), in_specs=P("dp"), out_specs=P("dp")))(shards)


def test_state_specs_for_another_device_count(shards):
    with pytest.raises(ValueError, match=r"state_specs: the shards were cut for 4 device\(s\), axis_size=2"):
        hj.state_specs(hj.zero(optax.adam(1e-2), "dp", stage=3), shards, "dp", axis_size=2)
