"""bucketed_all_reduce against psum/pmean of the tree; its HLO; its buffers against core.pack."""

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
from _jax_model import CAPS, loss, make_batch, make_params

WORLD = 4


def per_device_grads(n=WORLD, seed=3):
    """A stacked tree: leading axis = device, different values on every device."""
    r = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(r.normal(size=(n, *p.shape)).astype(p.dtype)), make_params())


def shard_mapped(fn, n=WORLD):
    mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))
    # Per-device trees travel stacked on a leading axis of size n.
    return jax.jit(jax.shard_map(lambda g: fn(jax.tree_util.tree_map(lambda x: x[0], g)), mesh=mesh,
                                 in_specs=P("dp"), out_specs=P()))


CASES = [  # (caps, mean): several buckets, one bucket per tree, sum and mean
    (CAPS, True), (CAPS, False), ({}, True), (dict(bucket_cap_bytes=64, first_bucket_cap_bytes=64), False),
]


@functools.cache
def plain_reduction(mean):
    """pmean / psum of the tree: the oracle, computed once per mode."""
    plain = jax.lax.pmean if mean else jax.lax.psum
    return shard_mapped(lambda g: plain(g, "dp"))(per_device_grads())


@pytest.mark.parametrize("caps,mean", CASES)
def test_equals_psum_of_tree(caps, mean):
    tx = hj.bucketed_all_reduce("dp", mean=mean, **caps)
    got = shard_mapped(lambda g: tx.update(g, tx.init(g))[0])(per_device_grads())
    want = plain_reduction(mean)
    # Same framework, same reduction of the same 4 values per element: only the bucket layout
    # differs, so float32 results agree to 1 ulp (rtol 1.3e-6 is 11 ulp-equivalents at worst).
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1.3e-6, atol=1e-6)


@pytest.mark.parametrize("caps", [CAPS, {}, dict(bucket_cap_bytes=64, first_bucket_cap_bytes=16)])
def test_hlo_has_one_all_reduce_per_bucket(caps):
    tx = hj.bucketed_all_reduce("dp", **caps)
    params = make_params()
    num_buckets = plan_buckets(hj.specs(params), **caps).num_buckets
    text = shard_mapped(lambda g: tx.update(g, tx.init(g))[0]).lower(per_device_grads()).as_text()
    ops = re.findall(r"stablehlo\.all_reduce", text)
    assert len(ops) == num_buckets, text
    # ...whereas a psum of the tree sends one collective per leaf.
    plain = shard_mapped(lambda g: jax.lax.psum(g, "dp")).lower(per_device_grads()).as_text()
    assert len(re.findall(r"stablehlo\.all_reduce", plain)) == len(jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("caps", [CAPS, {}])
def test_buffers_are_core_pack(caps, monkeypatch):
    sent = {}  # (bucket, device) -> the flat buffer handed to the collective

    def watching_reduce(flat, axis_name):
        bucket = len(traced)  # called once per bucket, in bucket order, at trace time
        traced.append(bucket)
        jax.debug.callback(lambda d, x: sent.__setitem__((bucket, int(d)), np.asarray(x)),
                           jax.lax.axis_index(axis_name), flat)
        return jax.lax.psum(flat, axis_name)

    traced = []
    monkeypatch.setattr(all_reduce_module, "_reduce", watching_reduce)
    tx = hj.bucketed_all_reduce("dp", **caps)
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
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
    tx = optax.chain(reduction, optax.sgd(0.1))
    params, (x, y) = make_params(), make_batch(0)

    def step(params, x, y):
        g = hj.local_grad(loss, "dp")(params, x, y)
        u, _ = tx.update(g, tx.init(params), params)
        return optax.apply_updates(params, u)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P()))
    return f.lower(params, x, y).compile().as_text()


@pytest.mark.parametrize("caps", [CAPS, {}])
def test_compiled_step_makes_no_extra_pass_over_buckets(caps):
    # The performance contract, checked on the optimized HLO of a train step rather than on
    # timings: a bucket is written once (its concatenate, the copy that fills it) and reduced
    # once; the mean's divide and the unpacking slices are fused into the optimizer's update of
    # each leaf, so no other instruction produces a bucket-sized buffer (an extra pass over it).
    plan = plan_buckets(hj.specs(make_params()), **caps)
    leaf_sizes = {s.numel for s in plan.specs if len(s.shape) == 1}  # would be ambiguous
    lengths = {f"f32[{b.length}]" for b in plan.buckets if b.length not in leaf_sizes}
    assert lengths, "the table must have buckets recognisable by their length"
    ops = _entry_ops(_sgd_step_hlo(hj.bucketed_all_reduce("dp", **caps)))
    fills = [n for n, op, _ in ops if op == "concatenate" or (op == "fusion" and "concatenate" in n)]
    assert len(fills) == plan.num_buckets, ops
    extra = [(n, op, shape) for n, op, shape in ops if shape in lengths and n not in fills
             and op not in ("all-reduce", "get-tuple-element", "bitcast", "parameter")]
    assert extra == [], f"instructions making an extra pass over a bucket: {extra}"
