"""zero(inner, stage=3) on ParamShards against the unsharded inner transform, and what stage 3 holds and sends."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import pack
from tests.jax._jax_model import CAPS, BATCH, assert_trees_close, loss, make_batch, make_params, reference
from tests.jax.zero3._zero3_run import cut, mesh_of, stage3_train

NUM_STEPS = 12
# As tests/jax/test_jax_zero.py: float32, a mean of per-device means against one mean over the
# batch, a few ulps per step (rtol 1e-6, atol 2e-7, ~3 ulps at 1). Stage 3 is not bitwise stage 2:
# its gradients are (test_gradient_slices_are_the_reduce_scattered_ddp_gradient), but XLA:CPU fuses
# the optimizer's last multiply into the parameter add on a slice, where stage 2's all-gather of
# the updates sits between them (1 ulp apart from step 5 on, measured).
RTOL, ATOL = 1e-6, 2e-7
DECAY = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # matrices only, optax's usual mask

INNER = {
    "adam": lambda ax: optax.adam(1e-2),
    "adamw_mask": lambda ax: optax.adamw(1e-2, weight_decay=0.1, mask=DECAY),
    "sgd_momentum": lambda ax: optax.sgd(0.05, momentum=0.9),
    "clip_adamw": lambda ax: optax.chain(hj.clip_by_global_norm(0.1, ax) if ax else optax.clip_by_global_norm(0.1),
                                         optax.adamw(1e-2, weight_decay=0.1)),
    # the chain a flax user already has, wrapped whole: zero rewrites optax's clip to its axis-aware twin
    "optax_chain_wrapped": lambda ax: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1)),
}


@functools.cache
def reference_history(name, num_steps=NUM_STEPS):
    return reference(INNER[name](None), make_params(), num_steps)


@functools.cache
def run_stage3(name, world_size, reshard_after_forward=True, num_steps=NUM_STEPS):
    """The unsharded params after each step, the final shards and state (cached: several tests
    look at the same runs)."""
    mesh = mesh_of(world_size)
    shards = cut(make_params(), mesh)
    init, step = stage3_train(hj.zero(INNER[name]("dp"), "dp", stage=3), mesh, shards,
                              reshard_after_forward=reshard_after_forward)
    state, history = init(shards), []
    for i in range(num_steps):
        shards, state = step(shards, state, *make_batch(i))
        history.append(hj.unshard_params(shards))
    return history, shards, state


CASES = [(name, n) for name in INNER for n in (2, 4)] + [("adamw_mask", 3)]


@pytest.mark.parametrize("name,world_size", CASES)
def test_stage3_equals_unsharded(name, world_size):
    history, _, _ = run_stage3(name, world_size)
    for i, (got, want) in enumerate(zip(history, reference_history(name))):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"step {i}")


def test_keeping_the_gathered_params_changes_nothing_but_the_program():
    # reshard_after_forward=False: no recomputation, the same numbers bit for bit.
    kept, _, _ = run_stage3("adamw_mask", 4, reshard_after_forward=False)
    regathered, _, _ = run_stage3("adamw_mask", 4)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(regathered), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mixed_params():
    # A bf16 leaf (a bucket of its own dtype) and a zero-size f16 one (an empty bucket: no collective).
    return {**make_params(), "scale": jnp.asarray([0.5, -1.25, 3.0], jnp.bfloat16),
            "empty": jnp.zeros((0,), jnp.float16)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_params_are_the_originals_bitwise(world_size):
    mesh, params = mesh_of(world_size), _mixed_params()
    shards = cut(params, mesh)
    assert len({b.dtype for b in shards.buckets}) == 3 and any(b.shape == (0,) for b in shards.buckets)
    every_device = jax.jit(jax.shard_map(lambda s: jax.tree.map(lambda x: x[None], hj.gather_params(s)),
                                         mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))(shards)
    for tree in [hj.unshard_params(shards)] + [jax.tree.map(lambda x: x[r], every_device) for r in range(world_size)]:
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(params), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, path
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gradient_slices_are_the_reduce_scattered_ddp_gradient(reshard_after_forward):
    mesh, params = mesh_of(4), make_params(seed=3)
    shards = cut(params, mesh)
    lay = shards.layout
    x, y = make_batch(0)

    def stage3(shards, x, y):
        return jax.grad(hj.gathered(loss, reshard_after_forward=reshard_after_forward))(shards, x, y).buckets

    def ddp(params, x, y):  # DDP's buckets of the per-device gradients, reduce-scattered
        arrays = lay.layout.spec_arrays(hj.local_grad(loss, "dp")(params, x, y))
        return tuple(jax.lax.psum_scatter(pack(lay.layout.plan, b, arrays, length=lay.shards.padded_length(b)), "dp",
                                          scatter_dimension=0, tiled=True) for b in range(lay.layout.plan.num_buckets))

    got = jax.jit(jax.shard_map(stage3, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))(shards, x, y)
    want = jax.jit(jax.shard_map(ddp, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P("dp")))(params, x, y)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And against the unsharded oracle: the sum of 4 local means is 4 times the full-batch mean's
    # gradient (float32, another order of additions: rtol 1e-6).
    full = lay.layout.spec_arrays(jax.grad(loss)(params, x, y))
    for b, a in enumerate(got):
        np.testing.assert_allclose(np.asarray(a), 4 * np.asarray(pack(lay.layout.plan, b, [np.asarray(f) for f in full],
                                                                      length=lay.shards.padded_length(b))),
                                   rtol=1e-6, atol=1e-7)


def _device_bytes(tree, device):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_params_and_state_held_between_steps_are_one_nth(name):
    world_size = 4
    _, shards, state = run_stage3(name, world_size)
    params = make_params()
    numel = sum(x.size for x in jax.tree.leaves(params))
    copies = 1 + sum(x.size for x in jax.tree.leaves(INNER[name](None).init(params)) if x.ndim) // numel  # + moments
    slices = shards.layout.shards
    num_buckets = len(slices.shard_sizes)
    scalars = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)  # step counts, on every device
    for device in jax.devices()[:world_size]:
        held = _device_bytes(shards, device) + _device_bytes(state, device) - scalars
        assert held == copies * slices.shard_numel(0) * 4
        # The unsharded params and state over the device count, plus under one element of padding
        # per bucket per copy.
        assert copies * numel * 4 / world_size <= held < copies * numel * 4 / world_size + copies * num_buckets * 4


def _lowered_counts(reshard_after_forward):
    mesh = mesh_of(4)
    shards = cut(_mixed_params(), mesh)
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    specs = hj.state_specs(tx, shards, "dp", axis_size=4)
    lossg = hj.gathered(lambda p, x, y: loss(p, x, y) + jnp.sum(p["scale"].astype(jnp.float32) ** 2),
                        reshard_after_forward=reshard_after_forward)

    def step(shards, state, x, y):
        u, state = tx.update(jax.grad(lossg)(shards, x, y), state, shards)
        return optax.apply_updates(shards, u), state

    state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs), shards)
    lowered = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp"), P("dp")),
                                    out_specs=(P("dp"), specs))).lower(shards, state, *make_batch(0))
    text = lowered.as_text()
    counts = {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ("all_reduce", "reduce_scatter", "all_gather",
                                                                        "pad")}
    compiled = len(re.findall(r"\ball-gather(-start)?\(", lowered.compile().as_text()))
    return counts, sum(1 for b in shards.buckets if b.shape[0]), compiled


@pytest.mark.parametrize("reshard_after_forward,cse_merges", [(True, False), (True, True), (False, False)])
def test_collectives_per_bucket(reshard_after_forward, cse_merges, monkeypatch):
    # What JAX hands XLA: an all-gather per bucket in the forward, a reduce-scatter per bucket, no
    # all-reduce (the update itself communicates nothing), nothing for an empty bucket; and with
    # reshard_after_forward, where the compiler keeps the regathers apart (XLA:CPU with its cse pass
    # disabled, as use_memory_first_xla_cpu does; other backends: cse_merges False), the backward
    # gathers again each bucket whose parameters it reads. This loss's backward reads one: layer
    # 1's (its weight, for the hidden activations' gradient). Layer 0's weight multiplies only the
    # input, which is not differentiated, and for scale ** 2 JAX computes the derivative 2 * scale
    # in the forward and keeps that. Where XLA:CPU's CSE would merge them (its default), gathered
    # asks for no regather: it would only split the gathered bucket twice.
    monkeypatch.setattr(hj.sharded._params, "cse_merges_regathers", lambda: cse_merges)
    counts, nonempty, compiled = _lowered_counts(reshard_after_forward)
    # zero3_plan in leaf order (a bias before its weight, so layer 1's bias shares a bucket with
    # layer 0's weight): three float32 buckets, and the bf16 one.
    assert nonempty == 4
    # The backward packs each bucket's gradient with one concatenate (the transpose of
    # gather_params' split), never a bucket-sized pad per member (the transpose of slices).
    regathers = 1 if reshard_after_forward and not cse_merges else 0
    assert counts == {"all_reduce": 0, "reduce_scatter": nonempty, "all_gather": nonempty + regathers, "pad": 0}
    # XLA:CPU drops optimization barriers and merges the backward's gathers with the forward's
    # identical ones: on host devices the compiled step gathers once per bucket either way
    # (docs/jax-zero.md says so; this pins it, so a change in XLA shows here).
    assert compiled == nonempty


def test_pmap_stage3_equals_unsharded():
    n, name = 4, "adamw_mask"
    tx = hj.zero(INNER[name]("dp"), "dp", stage=3)
    lossg = hj.gathered(loss)
    rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), make_params())
    shards = jax.pmap(lambda p: hj.shard_params(p, "dp", **CAPS), axis_name="dp")(rep)

    def step(shards, state, x, y):  # under pmap jax.grad is per device, as under shard_map here
        u, state = tx.update(jax.grad(lossg)(shards, x, y), state, shards)
        return optax.apply_updates(shards, u), state

    state = jax.pmap(tx.init, axis_name="dp")(shards)
    step = jax.pmap(step, axis_name="dp")
    for i in range(5):
        x, y = make_batch(i)
        shards, state = step(shards, state, x.reshape(n, BATCH // n, -1), y.reshape(n, BATCH // n, -1))
    # pmap stacks the devices' slices: in rank order they are the padded buckets.
    whole = hj.ParamShards(tuple(b.reshape(-1) for b in shards.buckets), shards.layout)
    assert_trees_close(hj.unshard_params(whole), reference_history(name)[4], rtol=RTOL, atol=ATOL)
