"""Which inner transforms zero accepts: wrapped non-elementwise ones refused, global skips exact.

The oracle is the unsharded optax transform: a refused inner is one whose sharded result would
differ from it (LAMB's trust ratio inside inject_hyperparams ran ~40% off before it was refused);
hybrid.jax.apply_if_finite inside zero must equal optax.apply_if_finite unsharded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from hybrid.jax._elementwise import _PROBE_RTOL, probe_difference
from _jax_model import CAPS, make_params


def lamb():
    return optax.lamb(1e-3, weight_decay=0.01)


def inject_lamb():
    return optax.inject_hyperparams(optax.lamb)(learning_rate=optax.linear_schedule(1e-3, 0.0, 100))


WRAPPED_LAMB = {
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=1e-3),
    "inject_hyperparams_schedule": inject_lamb,
    "inject_hyperparams_static": lambda: optax.inject_hyperparams(optax.lamb, static_args="eps")(1e-3, eps=1e-6),
    "multi_steps": lambda: optax.MultiSteps(lamb(), 4).gradient_transformation(),
    "multi_steps_object": lambda: optax.MultiSteps(lamb(), 4),
    "chain_of_inject": lambda: optax.chain(hj.clip_by_global_norm(1.0, "dp"), inject_lamb()),
    "named_chain": lambda: optax.named_chain(("clip", hj.clip_by_global_norm(1.0, "dp")), ("opt", lamb())),
    "named_chain_of_inject": lambda: optax.named_chain(("opt", inject_lamb())),
    "multi_steps_of_inject": lambda: optax.MultiSteps(inject_lamb(), 2).gradient_transformation(),
}


@pytest.mark.parametrize("name", list(WRAPPED_LAMB))
def test_wrapped_lamb_refused(name):
    with pytest.raises(ValueError, match=r"(?i)trust.ratio"):
        hj.zero(WRAPPED_LAMB[name](), "dp")
    hj.zero(WRAPPED_LAMB[name](), "dp", check_elementwise=False)  # the explicit opt-out


ELEMENTWISE = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "sgd": lambda: optax.sgd(0.1),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-4, weight_decay=0.1),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-2),
    "schedule": lambda: optax.adam(optax.cosine_decay_schedule(1e-3, 10)),
    "clip_adamw": lambda: optax.chain(hj.clip_by_global_norm(0.1, "dp"), optax.adamw(1e-3, weight_decay=0.1)),
    "named_chain": lambda: optax.named_chain(("clip", hj.clip_by_global_norm(1.0, "dp")), ("adam", optax.adam(1e-3))),
    "inject_adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-3, 0.0, 9)),
    "multi_steps_adam": lambda: optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
    "apply_if_finite": lambda: hj.apply_if_finite(optax.adam(1e-3), 3, "dp"),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_accepted_and_probe_equal(name):
    # Elementwise updates are the same numbers whole and on shards: bitwise for optax's
    # elementwise transforms; clip_by_global_norm's psum of partial norms moves the last bits.
    assert probe_difference(ELEMENTWISE[name](), "dp") <= 1e-5
    hj.zero(ELEMENTWISE[name](), "dp")


# The probe alone (without the name walk) on the non-elementwise transforms: far above its
# tolerance, whether optax's or written elsewhere.
NON_ELEMENTWISE = {
    "lamb": lamb, "inject_lamb": inject_lamb,
    "multi_steps_lamb": lambda: optax.MultiSteps(lamb(), 2).gradient_transformation(),
    "optax_clip": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3)),
    "adafactor": lambda: optax.adafactor(1e-3),
    "optax_apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-3), 3),
    "custom_normalize": lambda: optax.stateless(
        lambda u, p: jax.tree_util.tree_map(lambda x: x / jnp.linalg.norm(x), u)),
}


@pytest.mark.parametrize("name", list(NON_ELEMENTWISE))
def test_probe_finds_non_elementwise(name):
    assert probe_difference(NON_ELEMENTWISE[name](), "dp") > 100 * _PROBE_RTOL


def test_custom_non_elementwise_refused():
    with pytest.raises(ValueError, match="depending on other elements.*check_elementwise=False"):
        hj.zero(NON_ELEMENTWISE["custom_normalize"](), "dp")


@pytest.mark.parametrize("inner", [
    optax.apply_if_finite(optax.adam(1e-3), 3),
    optax.chain(hj.clip_by_global_norm(1.0, "dp"), optax.apply_if_finite(optax.adam(1e-3), 3)),
    optax.inject_hyperparams(optax.apply_if_finite, static_args="max_consecutive_errors")(optax.sgd(0.1), 2),
], ids=["plain", "chain", "inject_hyperparams"])
def test_optax_apply_if_finite_refused(inner):
    with pytest.raises(ValueError, match=r"apply_if_finite.*use hybrid\.jax\.apply_if_finite"):
        hj.zero(inner, "dp")


WORLD, NUM_STEPS = 4, 5
NAN_STEPS = {1: (1, 7), 2: (2, 0), 3: (2, 0)}  # step -> (device, element of layers.0.weight) of the one NaN


def per_device_grads(step):
    """One gradient tree per device (stacked), with one NaN on one device on the NAN_STEPS."""
    r = np.random.default_rng(100 + step)
    leaves, treedef = jax.tree_util.tree_flatten(make_params())
    stacked = [r.normal(size=(WORLD, x.size)).astype(np.float32) for x in leaves]
    if step in NAN_STEPS:
        device, element = NAN_STEPS[step]
        stacked[1][device, element] = np.nan  # leaf 1: layers.0.weight
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(g.reshape(WORLD, *x.shape))
                                                  for g, x in zip(stacked, leaves)])


@pytest.mark.parametrize("stage", [1, 2])
def test_apply_if_finite_decides_for_all_devices(stage):
    # max_consecutive_errors=1: step 1 (NaN on device 1) is skipped everywhere, step 2 too, step 3
    # (the second in a row) is applied with its NaN, as optax does unsharded.
    tx = hj.zero(hj.apply_if_finite(optax.adam(1e-2), 1, "dp"), "dp", stage=stage, **CAPS)
    ref = optax.apply_if_finite(optax.adam(1e-2), 1)
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
    specs = hj.state_specs(tx, make_params(), "dp", axis_size=WORLD)

    def step(params, state, g):
        u, state = tx.update(jax.tree_util.tree_map(lambda x: x[0], g), state, params)
        return optax.apply_updates(params, u), state

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs)))
    params = want = make_params()
    state, ref_state = init(params), ref.init(want)
    for i in range(NUM_STEPS):
        g = per_device_grads(i)
        params, state = step(params, state, g)
        u, ref_state = ref.update(jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), g), ref_state, want)
        want = optax.apply_updates(want, u)
        assert bool(state.inner.last_finite) == bool(ref_state.last_finite) == (i not in NAN_STEPS)
        # float32 mean of 4 per-device values, reduced by psum_scatter vs jnp.mean: a few ulps,
        # as in test_jax_zero (rtol 1e-6, atol 2e-7); NaNs must sit on the same elements.
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=2e-7,
                                       err_msg=f"step {i}")
    assert np.isnan(np.asarray(params["layers"][0]["weight"])).sum() == 1  # step 3's NaN, applied
