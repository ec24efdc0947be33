"""hybrid.jax.auto_bucket_plan and plan= (issue 25.2): buckets chosen from a cost model, executed
by bucketed_all_reduce and zero with the same results as their default caps.

Oracles as in test_jax_all_reduce / test_jax_zero: pmean of the tree, the unsharded optax
transform on the full-batch gradient; tolerances theirs (only the bucket layout differs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hybrid.jax as hj
from hybrid.core import CopyCost, CostModel, auto_plan, plan_buckets, ready_times_by_elements
from _jax_model import loss, make_batch, make_params, reference, shard_map_train
from test_jax_all_reduce import assert_trees_close, per_device_grads, plain_reduction, shard_mapped
from test_jax_zero import RTOL, ATOL

SIZES = (1 << 4, 1 << 10, 1 << 16)
# Latency far above the bytes' cost: the planner wants few buckets, but every leaf is ready at a
# different time; with the expensive copy, a leaf alone, in place, can pay off.
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
MODEL = CostModel.fit([(k, n, 1e-5 + n * 1e-6) for k in KINDS for n in SIZES], world_size=4)


def _plan(**kw):
    params = make_params()
    order = hj.gradient_ready_order(loss, params, *make_batch(0))
    return hj.auto_bucket_plan(params, MODEL, backward_s=2e-4, ready_order=order, copy=CopyCost(2e-7, 1e-6), **kw)


def test_auto_bucket_plan_is_auto_plan_over_the_trees_specs():
    params = make_params()
    order = hj.gradient_ready_order(loss, params, *make_batch(0))
    plan = _plan()
    specs = plan_buckets(hj.specs(params)).specs
    index = [next(i for i, s in enumerate(specs) if s.name == n) for n in order]
    want = auto_plan(specs, index, ready_times_by_elements(specs, index, 2e-4), MODEL, copy=CopyCost(2e-7, 1e-6))
    assert plan == want and plan.fingerprint() == want.fingerprint()
    assert 1 < plan.num_buckets < len(specs)  # neither one bucket nor one per leaf: a real choice


def test_bucketed_all_reduce_with_an_auto_plan_equals_pmean():
    tx = hj.bucketed_all_reduce("dp", plan=_plan())
    got = shard_mapped(lambda g: tx.update(g, tx.init(g))[0])(per_device_grads())
    assert_trees_close(got, plain_reduction(True))


def test_zero_with_an_auto_plan_equals_unsharded():
    plan = _plan(kind="reduce_scatter", after_step=[("all_gather", 1)])
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    tx = hj.zero(optax.adam(1e-2), "dp", stage=2, plan=plan)
    params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    state, history = init(params), []
    for i in range(5):
        params, state = step(params, state, *make_batch(i))
        history.append(params)
    for got, want in zip(history, reference(optax.adam(1e-2), make_params(), 5)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_measured_ready_times_and_bad_input():
    params = make_params()
    names = [s.name for s in hj.specs(params)][::-1]
    late_first = hj.auto_bucket_plan(params, MODEL, ready_order=names, ready_s=[0.0] + [1.0] * (len(names) - 1))
    assert [late_first.specs[m].name for m in late_first.buckets[0].members] == names[:1]  # alone, early
    with pytest.raises(ValueError, match="exactly one of them"):
        hj.auto_bucket_plan(params, MODEL)
    with pytest.raises(ValueError, match="no leaves of the tree"):
        hj.auto_bucket_plan(params, MODEL, backward_s=1.0, ready_order=["nope"])
    other = hj.auto_bucket_plan({"w": jnp.zeros(3)}, MODEL, backward_s=1.0)
    with pytest.raises(ValueError, match="other tensors than the tree's"):
        hj.bucketed_all_reduce("dp", plan=other).init(params)
    with pytest.raises(ValueError, match="give plan or ready_order"):
        hj.bucketed_all_reduce("dp", plan=_plan(), ready_order=names).init(params)
