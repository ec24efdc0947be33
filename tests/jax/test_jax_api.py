"""specs naming and order, the shard_map gradient trap, and errors on bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import TensorSpec, plan_buckets
from _jax_model import loss, make_batch, make_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:  # an equinox/flax-style module: leaves reached through attributes
    weight: jax.Array
    bias: jax.Array


@pytest.mark.parametrize("tree,names", [
    ({"layers": [{"weight": jnp.ones(2)}]}, ["layers.0.weight"]),
    ({"b": jnp.ones(1), "a": (jnp.ones(1), jnp.ones(2))}, ["a.0", "a.1", "b"]),
    ({"fc": Linear(jnp.ones((3, 2)), jnp.ones(3))}, ["fc.weight", "fc.bias"]),
    ([jnp.ones(1), {"x": jnp.ones(1)}], ["0", "1.x"]),
])
def test_specs_names(tree, names):
    assert [s.name for s in hj.specs(tree)] == names


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)])


@pytest.mark.parametrize("caps", [dict(bucket_cap_bytes=40, first_bucket_cap_bytes=16), {}])
def test_same_plan_and_fingerprint_as_torch(caps):
    module = TorchMLP()
    torch_specs = [TensorSpec(n, tuple(p.shape), "float32") for n, p in module.named_parameters()]
    # The same parameters as a JAX tree (torch's Linear weight is (out, in)).
    tree = {"layers": [{n: jnp.asarray(p.detach().numpy()) for n, p in lin.named_parameters()}
                       for lin in module.layers]}
    order = [n for n, _ in module.named_parameters()]
    want = plan_buckets(torch_specs, **caps)
    assert hj.specs(tree, order=order) == tuple(torch_specs)
    assert plan_buckets(hj.specs(tree, order=order), **caps).fingerprint() == want.fingerprint()
    # Without order the dict's sorted keys put bias before weight: a different registration order.
    assert [s.name for s in hj.specs(tree)][:2] == ["layers.0.bias", "layers.0.weight"]


@pytest.mark.parametrize("order,match", [(["w"], "leaves not named"), (["w", "b", "c"], "unknown names"),
                                         (["w", "w"], "exactly once")])
def test_specs_bad_order(order, match):
    with pytest.raises(ValueError, match=match):
        hj.specs({"w": jnp.ones(1), "b": jnp.ones(1)}, order=order)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_gradient_equals_full_batch(world_size):
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("dp",))
    tx = hj.bucketed_all_reduce("dp", bucket_cap_bytes=40, first_bucket_cap_bytes=16)
    params, (x, y) = make_params(), make_batch(0)

    def dp_grads(params, x, y):
        local = hj.local_grad(loss, "dp")(params, x, y)
        return tx.update(local, tx.init(params))[0]

    got = jax.jit(jax.shard_map(dp_grads, mesh=mesh, in_specs=(P(), P("dp"), P("dp")),
                                out_specs=P(), check_vma=True))(params, x, y)
    want = jax.grad(loss)(params, x, y)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        # the mean of per-device mean-loss gradients vs one full-batch mean: a few ulps apart
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1.3e-6, atol=1e-6)


def _jax_grad_step(name, **shard_map_kwargs):
    """A jitted shard_map step feeding plain jax.grad gradients to the transform ``name``."""
    tx = {"bucketed_all_reduce": optax.chain(hj.bucketed_all_reduce("dp"), optax.sgd(1.0)),
          "zero1": hj.zero(optax.sgd(1.0), "dp", stage=1),
          "zero2": hj.zero(optax.sgd(1.0), "dp", stage=2)}[name]
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))

    def step(params, x, y):
        return tx.update(jax.grad(loss)(params, x, y), tx.init(params), params)[0]

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P(),
                                 **shard_map_kwargs))


@pytest.mark.parametrize("name", ["bucketed_all_reduce", "zero1", "zero2"])
def test_jax_grad_inside_shard_map_is_refused(name):
    # jax.grad of P() params under shard_map is already the sum over "dp"; reducing it again gave
    # world_size x the update, silently. The type says so (invariant), so it is caught at trace time.
    with pytest.raises(ValueError, match=r"gradient leaf '.+' .*invariant over 'dp'.*hybrid\.jax\.local_grad"):
        _jax_grad_step(name)(make_params(), *make_batch(0))


@pytest.mark.parametrize("name", ["bucketed_all_reduce", "zero1", "zero2"])
def test_per_device_grads_accepted_where_jax_tracks_no_variance(name):
    # With check_vma=False (and under pmap) jax.grad does not sum over the axis: the gradient is
    # per device, nothing to catch, and one reduction gives the full-batch SGD step.
    params, (x, y) = make_params(), make_batch(0)
    got = _jax_grad_step(name, check_vma=False)(params, x, y)
    want = jax.tree_util.tree_map(lambda g: -g, jax.grad(loss)(params, x, y))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1.3e-6, atol=1e-6)


def test_local_grad_of_varying_params():
    # Parameters that already vary over the axis (P("dp") in_specs) are differentiated as they are;
    # the check reads JAX 0.10's manual_axis_type (the old .vma attribute no longer exists).
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    f = jax.shard_map(lambda w, x: hj.local_grad(lambda w, x: jnp.sum(w * x), "dp")(w, x), mesh=mesh,
                      in_specs=(P("dp"), P("dp")), out_specs=P("dp"))
    np.testing.assert_array_equal(np.asarray(f(jnp.ones(4), jnp.arange(4.0))), [0.0, 1.0, 2.0, 3.0])


def test_unbound_axis_names_the_bound_ones():
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    tx = hj.bucketed_all_reduce("batch")
    with pytest.raises(ValueError, match=r"axis name 'batch' is not bound; the axes bound here are \['dp'\]"):
        jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("dp"),
                      out_specs=P("dp"))(jnp.ones(4))


def _transforms():
    return {
        "bucketed_all_reduce": hj.bucketed_all_reduce("dp"),
        "zero1": hj.zero(optax.adam(1e-3), "dp", stage=1),
        "zero2": hj.zero(optax.adam(1e-3), "dp", stage=2),
        "clip": hj.clip_by_global_norm(1.0, "dp"),
    }


@pytest.mark.parametrize("name", ["bucketed_all_reduce", "zero1", "zero2", "clip"])
def test_unbound_axis(name):
    tx, params = _transforms()[name], make_params()
    with pytest.raises(ValueError, match="axis name 'dp' is not bound"):
        if name.startswith("zero"):
            tx.init(params)
        else:
            tx.update(params, tx.init(params))


@pytest.mark.parametrize("name", ["zero1", "zero2", "bucketed_all_reduce"])
@pytest.mark.parametrize("change", ["drop_leaf", "reshape", "rename"])
def test_structure_changes_between_init_and_update(name, change):
    tx = _transforms()[name]
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    other = {"drop_leaf": {"w": params["w"]}, "reshape": {"w": jnp.ones((3, 4)), "b": jnp.ones(3)},
             "rename": {"v": params["w"], "b": params["b"]}}[change]

    def run(init_tree, update_tree):
        state = tx.init(init_tree)
        return tx.update(update_tree, state, update_tree)

    what = "bucketed_all_reduce" if name == "bucketed_all_reduce" else "zero"
    with pytest.raises(ValueError, match=f"differs from the one {what}.init saw"):
        jax.vmap(run, in_axes=None, axis_size=4, axis_name="dp")(params, other)


@pytest.mark.parametrize("name", ["bucketed_all_reduce", "zero1", "zero2"])
def test_foreign_state(name):
    tx, params = _transforms()[name], make_params()
    with pytest.raises(TypeError, match="state must be the"):
        jax.vmap(lambda p: tx.update(p, optax.EmptyState(), p), in_axes=None, axis_size=4, axis_name="dp")(params)


@pytest.mark.parametrize("name", ["bucketed_all_reduce", "zero1", "zero2"])
def test_integer_leaves(name):
    tx = _transforms()[name]
    tree = {"w": jnp.ones(3), "step": jnp.ones(2, jnp.int32)}
    with pytest.raises(TypeError, match="leaf 'step' has dtype int32"):
        jax.vmap(lambda t: tx.update(t, tx.init(t), t), in_axes=None, axis_size=4, axis_name="dp")(tree)


@pytest.mark.parametrize("inner,culprit", [
    # a global-norm clip zero cannot rewrite: behind MultiSteps (in a chain it is rewritten, below)
    (optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 2), "clip_by_global_norm"),
    (optax.lamb(1e-3), "scale_by_trust_ratio"),
    (optax.adafactor(1e-3), "scale_by_factored_rms"),
    # a mask behind a wrapper zero does not rewrite (masks in chains are supported: test_jax_zero_masks)
    (optax.inject_hyperparams(optax.adamw)(1e-3, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)),
     "masked"),
])
def test_non_elementwise_inner_refused(inner, culprit):
    with pytest.raises(ValueError, match=culprit):
        hj.zero(inner, "dp")
    hj.zero(inner, "dp", check_elementwise=False)  # the explicit opt-out is accepted


def test_lamb_refusal_names_the_trust_ratio():
    with pytest.raises(ValueError) as e:
        hj.zero(optax.lamb(1e-3), "dp")
    assert "trust ratio" in str(e.value) and "bucketed_all_reduce" in str(e.value)
    assert "clip_by_global_norm" not in str(e.value)


@pytest.mark.parametrize("inner", [optax.adamw(1e-3), optax.lion(1e-3), optax.sgd(0.1, momentum=0.9),
                                   optax.chain(hj.clip_by_global_norm(1.0, "dp"), optax.adam(1e-3)),
                                   optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                                   optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("opt", optax.adam(1e-3))),
                                   optax.clip_by_global_norm(1.0)])
def test_elementwise_inner_accepted(inner):
    hj.zero(inner, "dp")


@pytest.mark.parametrize("kwargs,error", [
    (dict(stage=4), "stage must be 1, 2 or 3"), (dict(bucket_cap_bytes=-1), "bucket_cap_bytes"),
    (dict(first_bucket_cap_bytes=1.5), "first_bucket_cap_bytes"),
])
def test_bad_arguments(kwargs, error):
    with pytest.raises(ValueError, match=error):
        hj.zero(optax.sgd(0.1), "dp", **kwargs)


def test_params_tree_differs_from_updates():
    tx = hj.zero(optax.adamw(1e-3), "dp")
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}

    def run(p):
        return tx.update(p, tx.init(p), {"w": p["w"], "b": jnp.ones(2)})

    with pytest.raises(ValueError, match="params and updates must be trees"):
        jax.vmap(run, in_axes=None, axis_size=4, axis_name="dp")(params)
