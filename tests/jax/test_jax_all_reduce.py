"""bucketed_all_reduce against psum/pmean of the tree; its HLO; its buffers against core.pack.

Both bucket modes: persistent buckets (the default, filled in place across steps) and per-step
concatenated buckets (``persistent_buckets=False``).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
import hybrid.jax._all_reduce as all_reduce_module
from hybrid.core import pack, plan_buckets
from _jax_model import CAPS, make_batch, make_params, reference, shard_map_train

WORLD = 4


def per_device_grads(n=WORLD, seed=3):
    """A stacked tree: leading axis = device, different values on every device."""
    r = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(r.normal(size=(n, *p.shape)).astype(p.dtype)), make_params())


def shard_mapped(fn, n=WORLD, out_specs=P()):
    mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))
    # Per-device trees travel stacked on a leading axis of size n.
    return jax.jit(jax.shard_map(lambda *g: fn(*jax.tree_util.tree_map(lambda x: x[0], g)), mesh=mesh,
                                 in_specs=P("dp"), out_specs=out_specs))


CASES = [  # (caps, mean): several buckets, one bucket per tree, sum and mean
    (CAPS, True), (CAPS, False), ({}, True), (dict(bucket_cap_bytes=64, first_bucket_cap_bytes=64), False),
]


@functools.cache
def plain_reduction(mean, seed=3):
    """pmean / psum of the tree: the oracle, computed once per mode."""
    plain = jax.lax.pmean if mean else jax.lax.psum
    return shard_mapped(lambda g: plain(g, "dp"))(per_device_grads(seed=seed))


def assert_trees_close(got, want):
    # Same framework, same reduction of the same 4 values per element: only the bucket layout
    # differs, so float32 results agree to 1 ulp (rtol 1.3e-6 is 11 ulp-equivalents at worst).
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1.3e-6, atol=1e-6)


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("caps,mean", CASES)
def test_equals_psum_of_tree(caps, mean, persistent):
    tx = hj.bucketed_all_reduce("dp", mean=mean, persistent_buckets=persistent, **caps)
    got = shard_mapped(lambda g: tx.update(g, tx.init(g))[0])(per_device_grads())
    assert_trees_close(got, plain_reduction(mean))


@pytest.mark.parametrize("caps", [CAPS, {}])
def test_persistent_buckets_across_steps(caps):
    # Three updates through one state: each result must be the reduction of its own gradients
    # (the buffers' previous contents never leak in) and the state must hold this device's last
    # gradients packed as core.pack lays them out, padding zero.
    tx = hj.bucketed_all_reduce("dp", **caps)
    seeds = (3, 4, 5)

    def three_steps(g0, g1, g2):
        state, outs = tx.init(g0), []
        for g in (g0, g1, g2):
            u, state = tx.update(g, state)
            outs.append(u)
        return outs, state

    specs = hj.state_specs(tx, make_params(), "dp", axis_size=WORLD)
    outs, state = shard_mapped(three_steps, out_specs=(P(), specs))(*(per_device_grads(seed=s) for s in seeds))
    for out, seed in zip(outs, seeds):
        assert_trees_close(out, plain_reduction(True, seed))
    plan = plan_buckets(hj.specs(make_params()), **caps)
    last = per_device_grads(seed=seeds[-1])
    assert isinstance(state, hj.BucketedAllReduceState) and state.plan_fingerprint == plan.fingerprint()
    for b, buffer in enumerate(state.buckets):
        per_device = np.asarray(buffer).reshape(WORLD, -1)  # P("dp"): the devices' buffers end to end
        for d in range(WORLD):
            local = [np.asarray(x[d]) for x in jax.tree_util.tree_leaves(last)]
            np.testing.assert_array_equal(per_device[d], pack(plan, b, local))


def test_persistent_buckets_under_pmap():
    tx = hj.bucketed_all_reduce("dp", **CAPS)

    def two_steps(g0, g1):
        state = tx.init(g0)
        _, state = tx.update(g0, state)
        return tx.update(g1, state)[0]

    got = jax.pmap(two_steps, axis_name="dp")(per_device_grads(seed=3), per_device_grads(seed=4))
    assert_trees_close(jax.tree_util.tree_map(lambda x: x[0], got), plain_reduction(True, 4))


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("caps", [CAPS, {}, dict(bucket_cap_bytes=64, first_bucket_cap_bytes=16)])
def test_hlo_has_one_all_reduce_per_bucket(caps, persistent):
    tx = hj.bucketed_all_reduce("dp", persistent_buckets=persistent, **caps)
    params = make_params()
    num_buckets = plan_buckets(hj.specs(params), **caps).num_buckets
    text = shard_mapped(lambda g: tx.update(g, tx.init(g))[0]).lower(per_device_grads()).as_text()
    ops = re.findall(r"stablehlo\.all_reduce", text)
    assert len(ops) == num_buckets, text
    # ...whereas a psum of the tree sends one collective per leaf.
    plain = shard_mapped(lambda g: jax.lax.psum(g, "dp")).lower(per_device_grads()).as_text()
    assert len(re.findall(r"stablehlo\.all_reduce", plain)) == len(jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("caps", [CAPS, {}])
def test_buffers_are_core_pack(caps, persistent, monkeypatch):
    sent = {}  # (bucket, device) -> the flat buffer handed to the collective

    def watching_reduce(flat, axis_name):
        bucket = len(traced)  # called once per bucket, in bucket order, at trace time
        traced.append(bucket)
        jax.debug.callback(lambda d, x: sent.__setitem__((bucket, int(d)), np.asarray(x)),
                           jax.lax.axis_index(axis_name), flat)
        return jax.lax.psum(flat, axis_name)

    traced = []
    monkeypatch.setattr(all_reduce_module, "_reduce", watching_reduce)
    tx = hj.bucketed_all_reduce("dp", persistent_buckets=persistent, **caps)
    grads = per_device_grads()
    jax.block_until_ready(shard_mapped(lambda g: tx.update(g, tx.init(g))[0])(grads))
    plan = plan_buckets(hj.specs(make_params()), **caps)
    assert len(traced) == plan.num_buckets
    for b in range(plan.num_buckets):
        for d in range(WORLD):
            local = [np.asarray(x[d]) for x in jax.tree_util.tree_leaves(grads)]
            np.testing.assert_array_equal(sent[(b, d)], pack(plan, b, local))


def _entry_ops(text):
    """``(name, opcode, result shape)`` of the ENTRY instructions of optimized HLO."""
    entry = text[text.index("\nENTRY "):]
    ops = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ([a-z][a-z0-9\-]*)\(", line)
        if m:
            ops.append((m.group(1), m.group(3), m.group(2).split("{")[0]))
    return ops


def _sgd_step_hlo(reduction):
    """Optimized HLO of a shard_map SGD step that carries (and donates) the reduction's state."""
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
    params, (x, y) = make_params(), make_batch(0)
    init, step = shard_map_train(optax.chain(reduction, optax.sgd(0.1)), mesh, params, donate_state=True)
    return step.lower(params, init(params), x, y).compile().as_text()


def _bucket_shapes(caps):
    plan = plan_buckets(hj.specs(make_params()), **caps)
    leaf_sizes = {s.numel for s in plan.specs if len(s.shape) == 1}  # would be ambiguous
    lengths = {f"f32[{b.length}]" for b in plan.buckets if b.length not in leaf_sizes}
    assert lengths, "the table must have buckets recognisable by their length"
    return plan, lengths


@pytest.mark.parametrize("caps", [CAPS, {}])
def test_compiled_step_makes_no_extra_pass_over_buckets(caps):
    # The performance contract of per-step buckets, checked on the optimized HLO of a train step
    # rather than on timings: a bucket is written once (its concatenate, the copy that fills it)
    # and reduced once; the mean's divide and the unpacking slices are fused into the optimizer's
    # update of each leaf, so no other instruction produces a bucket-sized buffer (an extra pass).
    plan, lengths = _bucket_shapes(caps)
    ops = _entry_ops(_sgd_step_hlo(hj.bucketed_all_reduce("dp", persistent_buckets=False, **caps)))
    fills = [n for n, op, _ in ops if op == "concatenate" or (op == "fusion" and "concatenate" in n)]
    assert len(fills) == plan.num_buckets, ops
    extra = [(n, op, shape) for n, op, shape in ops if shape in lengths and n not in fills
             and op not in ("all-reduce", "get-tuple-element", "bitcast", "parameter")]
    assert extra == [], f"instructions making an extra pass over a bucket: {extra}"


@pytest.mark.parametrize("caps", [CAPS, {}])
def test_compiled_step_fills_persistent_buckets_in_place(caps):
    # Persistent buckets: every bucket-sized instruction besides the all-reduce is a
    # dynamic-update-slice fusion on the previous value of the same buffer, a chain that starts at
    # the donated state parameter and ends as the step's output aliased to it. That is XLA's
    # in-place update: no concatenate, no copy, no fresh bucket-sized buffer to fill.
    plan, lengths = _bucket_shapes(caps)
    text = _sgd_step_hlo(hj.bucketed_all_reduce("dp", **caps))
    entry = text[text.index("\nENTRY "):]
    operands = dict(re.findall(r"%(\S+) = \S+ (?:fusion|dynamic-update-slice)\(%([^,)]+)", entry))
    ops = _entry_ops(text)
    params = {n for n, op, shape in ops if op == "parameter" and shape in lengths}
    assert len(params) == sum(f"f32[{b.length}]" in lengths for b in plan.buckets)
    ends = set()
    for name, op, shape in ops:
        if shape not in lengths or op in ("parameter", "all-reduce", "get-tuple-element", "bitcast"):
            continue
        assert op == "fusion" and "dynamic-update-slice" in name, f"extra pass over a bucket: {name} = {op}"
        first = operands[name]
        assert first in params or first in operands, f"{name} does not update a bucket in place"
        ends.add(name)
        ends.discard(first)
    assert ends and all(op != "concatenate" and op != "copy" for _, op, s in ops if s in lengths)
    root = re.search(r"ROOT %\S+ = .* tuple\((.*)\)", entry).group(1)
    assert ends <= set(re.findall(r"%(\S+?)[,)]?(?:\s|$)", root + " ")), (ends, root)
    header = text.splitlines()[0]
    aliased = {int(i) for i in re.findall(r"\((\d+), \{\}, may-alias\)", header)}
    param_numbers = {int(re.search(rf"%{re.escape(p)} = \S+ parameter\((\d+)\)", entry).group(1)) for p in params}
    assert param_numbers <= aliased, (param_numbers, header[:300])


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("world_size", [2, 4])
def test_train_steps_equal_full_batch_adam(world_size, persistent):
    # A training loop as users write it: jitted shard_map step, default check_vma, specs from
    # state_specs (per-device bucket buffers, replicated adam moments), state donated. Its
    # parameters must follow adam on the full-batch gradient step for step.
    num_steps = 8
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("dp",))
    tx = optax.chain(hj.bucketed_all_reduce("dp", persistent_buckets=persistent, **CAPS), optax.adam(1e-2))
    params = make_params()
    init, step = shard_map_train(tx, mesh, params, donate_state=True)
    state = init(params)
    ref = reference(optax.adam(1e-2), make_params(), num_steps)
    for i in range(num_steps):
        params, state = step(params, state, *make_batch(i))
        # a mean of per-device batch means against one full-batch mean: a few ulps per step, as
        # in test_jax_zero (rtol 1e-6, atol 2e-7)
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref[i]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=2e-7, err_msg=f"step {i}")
