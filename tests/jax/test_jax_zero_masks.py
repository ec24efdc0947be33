"""Weight-decay masks and param groups inside zero, against the same optax transform unsharded.

Before, zero refused every mask (``masked``, ``adamw(mask=...)``, ``multi_transform``) as not
elementwise, and with ``check_elementwise=False`` a callable mask saw the flat 1-D slices (no leaf
with ndim > 1: no weight decay at all, parameters 3.5e-2 off after 30 steps).
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hybrid.jax as hj
from _jax_model import CAPS, make_batch, make_params, max_abs_diff, reference, shard_map_train

NUM_STEPS = 10
# float32, same framework: the sharded gradient is a mean of per-device means, the reference one
# mean over the batch (a few ulps per step), as in test_jax_zero; the masked arithmetic itself is
# the unsharded one element by element (jnp.where picks optax's result or the passed-through one).
RTOL, ATOL = 1e-6, 2e-7


def is_matrix(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def group(params):
    return jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no_decay", params)


def frozen_first_layer(params):
    return {"layers": ["frozen", "train"]}  # a prefix of the params tree


MASK_TREE = is_matrix(make_params())

# name -> factory(axis_name or None): the hybrid clip inside zero, optax's in the reference.
CASES = {
    "masked_tree": lambda ax: optax.chain(optax.scale_by_adam(), optax.masked(optax.add_decayed_weights(0.1), MASK_TREE),
                                          optax.scale(-1e-2)),
    "masked_callable_momentum": lambda ax: optax.chain(optax.masked(optax.trace(0.9), is_matrix), optax.scale(-0.05)),
    "adamw_mask": lambda ax: optax.adamw(1e-2, weight_decay=0.1, mask=is_matrix),
    "add_decayed_weights_mask": lambda ax: optax.chain(optax.add_decayed_weights(0.2, mask=MASK_TREE), optax.sgd(0.05)),
    "multi_transform": lambda ax: optax.multi_transform(
        {"decay": optax.adamw(1e-2, weight_decay=0.1), "no_decay": optax.adam(1e-2)}, group),
    "multi_transform_frozen": lambda ax: optax.multi_transform(
        {"frozen": optax.set_to_zero(), "train": optax.adamw(1e-2, weight_decay=0.1)}, frozen_first_layer),
    # the clip's norm covers the masked-in leaves only, as optax's does
    "masked_clip": lambda ax: optax.chain(
        optax.masked(hj.clip_by_global_norm(0.05, ax) if ax else optax.clip_by_global_norm(0.05), is_matrix),
        optax.adam(1e-2)),
}


@functools.cache
def reference_history(name):
    return reference(CASES[name](None), make_params(), NUM_STEPS)


TABLE = ([(name, stage, 1) for name in CASES for stage in (1, 2)] + [(name, 2, 4) for name in CASES]
         + [("adamw_mask", 1, 3), ("multi_transform", 1, 3)])  # 3 devices: padding in every bucket


@pytest.mark.parametrize("name,stage,world_size", TABLE)
def test_masks_inside_zero_equal_unsharded(name, stage, world_size):
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("dp",))
    tx = hj.zero(CASES[name]("dp"), "dp", stage=stage, **CAPS)
    params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    state = init(params)
    for i, want in enumerate(reference_history(name)):
        params, state = step(params, state, *make_batch(i))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {i} {jax.tree_util.keystr(path)}")
    print(f"{name}, stage {stage}, {world_size} devices: max |param diff| after {NUM_STEPS} steps "
          f"{max_abs_diff(params, want):.1e}")


def test_frozen_leaves_do_not_move():
    # set_to_zero under its label: the first layer keeps its initial values bit for bit.
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    tx = hj.zero(CASES["multi_transform_frozen"]("dp"), "dp", **CAPS)
    start = params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    state = init(params)
    for i in range(3):
        params, state = step(params, state, *make_batch(i))
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(params["layers"][0][key]), np.asarray(start["layers"][0][key]))
        assert not np.array_equal(np.asarray(params["layers"][1][key]), np.asarray(start["layers"][1][key]))


def _init(tx, world_size=2):
    return jax.vmap(tx.init, in_axes=None, axis_size=world_size, axis_name="dp")(make_params())


def test_unknown_label_named():
    tx = hj.zero(optax.multi_transform({"decay": optax.adamw(1e-2)}, group), "dp", **CAPS)
    with pytest.raises(ValueError, match=r"optax.partition labels \['no_decay'\] have no transform"):
        _init(tx)


def test_mask_not_a_prefix_named():
    tx = hj.zero(optax.adamw(1e-2, mask={"other": True}), "dp", **CAPS)
    with pytest.raises(ValueError, match="optax.masked mask inside zero is not the params tree or a prefix of it"):
        _init(tx)


@pytest.mark.parametrize("inner", [
    optax.MultiSteps(optax.adamw(1e-2, mask=is_matrix), 2).gradient_transformation(),
    optax.masked(optax.lamb(1e-3), is_matrix),
], ids=["mask_behind_multi_steps", "non_elementwise_inside_mask"])
def test_masks_zero_cannot_rewrite_are_refused(inner):
    with pytest.raises(ValueError, match=r"zero: inner transform uses \['(masked|scale_by_trust_ratio)'"):
        hj.zero(inner, "dp")
