"""bucketed_all_reduce against psum/pmean of the tree; its HLO; its buffers against core.pack."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
import hybrid.jax._all_reduce as all_reduce_module
from hybrid.core import pack, plan_buckets
from _jax_model import CAPS, make_params

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


@pytest.mark.parametrize("caps,mean", CASES)
def test_equals_psum_of_tree(caps, mean):
    tx = hj.bucketed_all_reduce("dp", mean=mean, **caps)
    plain = jax.lax.pmean if mean else jax.lax.psum
    got = shard_mapped(lambda g: tx.update(g, tx.init(g))[0])(per_device_grads())
    want = shard_mapped(lambda g: plain(g, "dp"))(per_device_grads())
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
