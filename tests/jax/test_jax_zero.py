"""zero(inner) against the unsharded inner transform on the full-batch gradient."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hybrid.jax as hj
from hybrid.core import plan_buckets, shard_flat
from _jax_model import CAPS, loss, make_batch, make_params, reference, shard_map_train

NUM_STEPS = 20
# float32, same framework: the data-parallel gradient is a mean of per-device means where the
# reference takes one mean over the batch, so sums differ in order by a few ulps per step; over
# 20 steps the worst element measured is ~4e-8 beyond rtol 1e-6, hence atol 2e-7 (~3 ulps at 1).
RTOL, ATOL = 1e-6, 2e-7

INNER = {
    "sgd_momentum": lambda ax: optax.sgd(0.05, momentum=0.9),
    "adam": lambda ax: optax.adam(1e-2),
    "adamw": lambda ax: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda ax: optax.lion(1e-3, weight_decay=0.1),
    # a small max_norm so clipping triggers on every step
    "clip_adamw": lambda ax: optax.chain(hj.clip_by_global_norm(0.1, ax) if ax else optax.clip_by_global_norm(0.1),
                                         optax.adamw(1e-2, weight_decay=0.1)),
    # the chain a flax user already has, wrapped whole: zero rewrites optax's clip to its axis-aware twin
    "optax_chain_wrapped": lambda ax: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1)),
}


def _check(history, ref):
    for i, (got, want) in enumerate(zip(history, ref)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {i} {jax.tree_util.keystr(path)}")


@functools.cache
def reference_history(name, num_steps=NUM_STEPS):
    """The unsharded inner transform's parameters after each step (computed once per name)."""
    return reference(INNER[name](None), make_params(), num_steps)


@functools.cache
def run_shard_map(name, stage, world_size, *, jit=True, num_steps=NUM_STEPS):
    """A sharded run's parameters after each step and its final state. Cached: the equality and
    the state-size tests look at the same runs, compiled once."""
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("dp",))
    tx = hj.zero(INNER[name]("dp"), "dp", stage=stage, **CAPS)
    params = make_params()
    init, step = shard_map_train(tx, mesh, params, jit=jit)
    state, history = init(params), []
    for i in range(num_steps):
        params, state = step(params, state, *make_batch(i))
        history.append(params)
    return history, state


# Every inner transform at both stages on 4 devices. On 3 devices (shards that do not divide the
# buckets: padding in every bucket) the clip, whose global norm couples all shards, at both
# stages, and stage 2 of the three inners whose state sizes test_state_bytes_per_device checks;
# the elementwise inners treat padding alike (zero gradient, zero parameter stay zero).
SHARD_MAP_CASES = ([(name, stage, 4) for name in INNER for stage in (1, 2)]
                   + [("clip_adamw", 1, 3), ("clip_adamw", 2, 3)]
                   + [(name, 2, 3) for name in ("adam", "sgd_momentum", "lion")])


@pytest.mark.parametrize("name,stage,world_size", SHARD_MAP_CASES)
def test_zero_shard_map_equals_unsharded(name, stage, world_size):
    history, _ = run_shard_map(name, stage, world_size)
    _check(history, reference_history(name))


@pytest.mark.parametrize("stage", [2])  # stage 1 differs only in its collective; jitted table has it
def test_zero_shard_map_not_jitted(stage):
    # Eager shard_map compiles and dispatches every op on its own (~15 s for init and one step on
    # 2 cores): one step, with the inner of fewest ops (this checks the eager path: collectives,
    # axis_index, slicing; the inners' math is covered by the jitted table over 20 steps).
    history, _ = run_shard_map("sgd_momentum", stage, 4, jit=False, num_steps=1)
    _check(history, reference_history("sgd_momentum", 1))


# pmap is the older path (maintenance mode in JAX): the same transform code runs under it, so
# both stages with the two inners that use params shards and a cross-shard psum suffice.
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["adamw", "clip_adamw"])
def test_zero_pmap_equals_unsharded(name, stage):
    n = 4
    tx = hj.zero(INNER[name]("dp"), "dp", stage=stage, **CAPS)
    params = make_params()
    rep = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)

    def step(params, state, x, y):
        # Under pmap parameters are per device already: plain jax.grad is the local gradient.
        g = jax.grad(loss)(params, x, y)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    state = jax.pmap(tx.init, axis_name="dp")(rep)
    step = jax.pmap(step, axis_name="dp")
    history = []
    for i in range(NUM_STEPS):
        x, y = make_batch(i)
        rep, state = step(rep, state, x.reshape(n, -1, 5), y.reshape(n, -1, 2))
        history.append(jax.tree_util.tree_map(lambda a: a[0], rep))
        for a in jax.tree_util.tree_leaves(rep):  # every device holds the same parameters
            np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(a[0]), a.shape))
    _check(history, reference_history(name))


def _bytes(tree):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("world_size", [4, 3])
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion"])
def test_state_bytes_per_device(name, world_size):
    _, state = run_shard_map(name, 2, world_size)  # the runs test_zero_shard_map_equals_unsharded made
    unsharded = INNER[name](None).init(make_params())
    shards = shard_flat(plan_buckets(hj.specs(make_params()), **CAPS), world_size)
    num_buckets = len(shards.shard_sizes)
    padding = shards.shard_numel(0) * world_size - sum(s.numel for s in hj.specs(make_params()))
    assert 0 < padding, "the table must exercise padding"
    for device in mesh_devices(world_size):
        # The actual per-device buffers of the sharded state.
        local = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(state)
                    for s in x.addressable_shards if s.device == device)
        full_leaves = [x for x in jax.tree_util.tree_leaves(unsharded) if x.ndim > 0]
        scalars = sum(x.nbytes for x in jax.tree_util.tree_leaves(unsharded) if x.ndim == 0)
        scalars += state.plan_tag.nbytes  # ZeroState's plan tag: one uint32 on every device
        arrays = sum(x.nbytes for x in full_leaves)
        copies = arrays // sum(x.nbytes for x in jax.tree_util.tree_leaves(make_params()))  # mu, nu: 2
        # unsharded / world_size, plus under one element per state copy per bucket of padding
        assert arrays / world_size <= local - scalars < arrays / world_size + copies * num_buckets * 4
        assert local - scalars == copies * shards.shard_numel(0) * 4


def mesh_devices(n):
    return jax.devices()[:n]


@pytest.mark.parametrize("stage", [1, 2])
def test_bucket_of_zero_size_leaves(stage):
    # A bf16 leaf of shape (0,) beside the f32 weights: a bucket of its own dtype with nothing in
    # it, so no collective over it (XLA refuses to lower one). The f32 buckets are unchanged, so
    # the run equals the unsharded transform within the table's tolerances.
    params = {**make_params(), "empty": jnp.zeros((0,), jnp.bfloat16)}
    assert [b.length for b in plan_buckets(hj.specs(params), **CAPS).buckets if b.dtype == "bfloat16"] == [0]
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    init, step = shard_map_train(hj.zero(INNER["adamw"]("dp"), "dp", stage=stage, **CAPS), mesh, params)
    state, history = init(params), []
    for i in range(3):
        params, state = step(params, state, *make_batch(i))
        assert params["empty"].shape == (0,) and params["empty"].dtype == jnp.bfloat16
        history.append({"layers": params["layers"]})
    _check(history, reference_history("adamw", 3))


def _collectives(stage):
    """Counts of the collectives in a lowered zero step (StableHLO), and the number of buckets."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    params = make_params()
    init, step = shard_map_train(hj.zero(optax.adam(1e-2), "dp", stage=stage, **CAPS), mesh, params)
    text = step.lower(params, jax.eval_shape(init, params), *make_batch(0)).as_text()
    counts = {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return counts, plan_buckets(hj.specs(params), **CAPS).num_buckets


@pytest.mark.parametrize("stage", [1, 2])
def test_step_communicates_what_ddp_does(stage):
    # ZeRO's P_os: one reduce-scatter and one all-gather per bucket (together the volume of DDP's
    # one all-reduce), at stage 1 as at stage 2; no all-reduce of a bucket.
    counts, num_buckets = _collectives(stage)
    assert counts == {"all_reduce": 0, "reduce_scatter": num_buckets, "all_gather": num_buckets}


def test_stages_give_identical_results():
    # One program at both stages, so the same bits.
    for a, b in zip(jax.tree_util.tree_leaves(run_shard_map("adam", 1, 4)),
                    jax.tree_util.tree_leaves(run_shard_map("adam", 2, 4)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sum_instead_of_mean():
    # mean=False: the devices' gradients summed, not averaged, through the same path (params
    # given, so the parameters' slices are taken beside the reduced gradients). sgd(1.0) returns
    # -sum exactly but for the reduce-scatter's order of 4 float32 additions: rtol 1e-6.
    n, params = 4, make_params()
    grads = jax.tree.map(lambda p: np.random.default_rng(p.size).normal(size=(n, *p.shape)).astype(np.float32),
                         params)
    tx = hj.zero(optax.sgd(1.0), "dp", stage=2, mean=False, **CAPS)
    rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)
    updates = jax.pmap(lambda g, p: tx.update(g, tx.init(p), p)[0], axis_name="dp")(grads, rep)
    for got, g in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(grads), strict=True):
        for device in range(n):  # every device gets the whole update
            np.testing.assert_allclose(np.asarray(got[device]), -g.sum(0), rtol=1e-6, atol=1e-6)
