"""Stage-3 planning in the core: forward order, gather windows, per-rank memory, step cost by prefetch."""

import pytest
from hypothesis import given, settings, strategies as st

from hybrid.core import (OPTIMIZER_STATE_COPIES, TensorSpec, forward_order, gather_windows, itemsize, plan_buckets,
                         shard_flat, step_cost, zero3_memory, zero_memory)
from tests.core.strategies import spec_lists

SPECS = [TensorSpec(f"w{i}", (64 * (i % 3 + 1), 33), "float32") for i in range(12)]
CAPS = dict(bucket_cap_bytes=40_000, first_bucket_cap_bytes=20_000)


@settings(max_examples=60, deadline=None)
@given(spec_lists(keys=[("float32", "cpu")], sparse=False), st.integers(16, 4000))
def test_registration_order_is_the_default_forward_order(specs, cap):
    # One dtype and device: the plan is the reversed registration order cut by the caps, so a
    # forward that uses tensors in registration order uses the buckets in reverse plan order.
    plan = plan_buckets(specs, size_limits=[cap])
    assert forward_order(plan, first_use=range(len(specs))) == forward_order(plan) == tuple(
        reversed(range(plan.num_buckets)))


@settings(max_examples=60, deadline=None)
@given(spec_lists(sparse=False), st.randoms(use_true_random=False), st.data())
def test_observed_order_sorts_buckets_by_their_first_member(specs, rnd, data):
    plan = plan_buckets(specs, size_limits=[256])
    used = list(range(len(specs)))
    rnd.shuffle(used)
    used = used[:data.draw(st.integers(0, len(used)))]  # some tensors never seen
    order = forward_order(plan, first_use=used)
    assert sorted(order) == list(range(plan.num_buckets))
    position = {i: k for k, i in enumerate(used)}
    firsts = [min((position.get(m, len(used)) for m in plan.buckets[b].members), default=len(used)) for b in order]
    assert firsts == sorted(firsts)
    unseen = [b for b, f in zip(order, firsts) if f == len(used)]
    assert unseen == sorted(unseen, reverse=True)


def test_bad_first_use_names_the_culprits():
    plan = plan_buckets(SPECS, **CAPS)
    with pytest.raises(ValueError, match=r"out of range \[12\], repeated \[3\]"):
        forward_order(plan, first_use=[3, 3, 12])
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        gather_windows((0, 1), prefetch=-1)
    with pytest.raises(ValueError, match="every bucket index"):
        zero3_memory(shard_flat(plan, 2), 8, order=[0])


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_windows_hold_each_bucket_from_its_prefetch_to_its_compute(prefetch):
    order = (4, 2, 0, 1, 3)
    windows = gather_windows(order, prefetch)
    for k, w in enumerate(windows):
        assert w[0] == order[k] and len(w) == min(prefetch + 1, len(order) - k)
    for k, b in enumerate(order):  # gathered when prefetched, held until it has computed
        assert [i for i, w in enumerate(windows) if b in w] == list(range(max(0, k - prefetch), k + 1))


@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_persistent_bytes_are_the_papers_over_n_plus_padding(world_size, optimizer):
    # Two paths to one number: the paper's formula on the specs, and the flat slices of the plan
    # (every bucket padded to a multiple of the world size: under one element per bucket per copy).
    plan = plan_buckets(SPECS, **CAPS)
    shards = shard_flat(plan, world_size)
    paper = zero_memory(SPECS, world_size, optimizer)
    m = zero3_memory(shards, paper.state_bytes_per_param)
    persistent = m.param_bytes + m.grad_bytes + m.state_bytes
    copies = 2 + OPTIMIZER_STATE_COPIES[optimizer]
    assert paper.zero3 <= persistent < paper.zero3 + copies * 4 * plan.num_buckets
    assert m.param_bytes * world_size == sum(shards.padded_length(b) * 4 for b in range(plan.num_buckets))
    assert m.total == persistent + m.gathered_bytes


def test_gathered_working_set_by_prefetch():
    plan = plan_buckets(SPECS, **CAPS)
    shards = shard_flat(plan, 4)
    full = [shards.padded_length(b) * itemsize(b_.dtype) for b, b_ in enumerate(plan.buckets)]
    assert plan.num_buckets >= 4
    gathered = [zero3_memory(shards, 8, prefetch=p).gathered_bytes for p in range(plan.num_buckets + 1)]
    # Without prefetch the peak is the backward's: one bucket's parameters and its gradient.
    assert gathered[0] == 2 * max(full)
    assert gathered == sorted(gathered) and gathered[0] < gathered[-1]
    # Prefetching every bucket holds them all, as keeping the forward's buckets does.
    keep = zero3_memory(shards, 8, reshard_after_forward=False).gathered_bytes
    assert gathered[plan.num_buckets - 1] == keep == sum(full) + full[forward_order(plan)[-1]]


def test_step_cost_prefetch_hides_more_of_slow_gathers():
    # Gathers as slow as a bucket's compute: with nothing prefetched each forward slice waits for
    # its own gather; one ahead hides them behind the previous slice.
    plan = plan_buckets(SPECS, **CAPS)
    per_bucket_fwd = 1.0 / plan.num_buckets
    cost = lambda prefetch: step_cost(plan, 4, 3, lambda k, n: per_bucket_fwd, forward_s=1.0, backward_s=2.0,
                                      prefetch=prefetch)
    exposed = [cost(p).exposed_s for p in (0, 1, 2)]
    assert exposed[0] > exposed[1] >= exposed[2]
    assert len({cost(p).wire_bytes for p in (0, 1, 2)}) == 1  # the same bytes, scheduled differently
