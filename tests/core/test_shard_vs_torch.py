"""ZeRO ownership against torch's ZeroRedundancyOptimizer as the oracle.

torch's "fake" process group lets one process pose as rank 0 of any world size, so torch's own
partitioning code runs unmodified. Exact equality: integer algorithms.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import TensorSpec, assign_buckets, partition_params, plan_buckets

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402


@pytest.fixture(scope="module")
def fake_world():
    def init(world_size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_partition(sizes_per_group, world_size):
    params = [[torch.nn.Parameter(torch.zeros(n)) for n in sizes] for sizes in sizes_per_group]
    index = {id(p): i for i, p in enumerate(p for g in params for p in g)}
    zero = ZeroRedundancyOptimizer(params[0], torch.optim.SGD, lr=0.1)
    for group in params[1:]:
        zero.add_param_group({"params": group})
    return [[[index[id(p)] for p in g["params"]] for g in rank] for rank in zero._partition_parameters()]


def hybrid_partition(sizes_per_group, world_size):
    specs, groups = [], []
    for sizes in sizes_per_group:
        groups.append(list(range(len(specs), len(specs) + len(sizes))))
        specs += [TensorSpec(f"p{len(specs) + k}", (n,), "float32") for k, n in enumerate(sizes)]
    partition = partition_params(specs, world_size, groups=groups)
    return [[list(g) for g in rank] for rank in partition.per_rank], partition


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_balanced_example_from_torch_tests(fake_world, world_size):
    # torch's test_zero_redundancy_optimizer: sizes [9, 7, 5, 3] * world_size balance exactly.
    fake_world(world_size)
    sizes = [[9, 7, 5, 3] * world_size]
    ours, partition = hybrid_partition(sizes, world_size)
    assert ours == torch_partition(sizes, world_size)
    assert partition.numel_per_rank() == [24] * world_size


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 5),
       sizes=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), min_size=1, max_size=3))
def test_random_groups_match_torch(fake_world, world_size, sizes):
    fake_world(world_size)
    assert hybrid_partition(sizes, world_size)[0] == torch_partition(sizes, world_size)


def torch_bucket_assignment(plan, world_size, shard_buckets):
    params = [torch.nn.Parameter(torch.zeros(s.shape)) for s in plan.specs]
    index = {id(p): i for i, p in enumerate(params)}
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    info = zero._overlap_info
    info.shard_buckets = shard_buckets
    info.total_size = 0
    for bucket in plan.buckets:  # what ddp_zero_hook's _save_ddp_bucket_info records
        info.params_per_bucket.append([params[m] for m in bucket.members])
        info.total_size += sum(bucket.numels)
    info.status = _OverlapStatus.INITIALIZED
    per_rank = zero._bucket_assignments_per_rank
    return [sorted((b, a.offset, [index[id(p)] for p in a.parameters]) for b, a in rank.items())
            for rank in per_rank]


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 4), shard_buckets=st.booleans(),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=25), cap=st.integers(16, 600))
def test_bucket_assignment_matches_ddp_zero_hook(fake_world, world_size, shard_buckets, sizes, cap):
    fake_world(world_size)
    specs = [TensorSpec(f"p{i}", (n,), "float32") for i, n in enumerate(sizes)]
    plan = plan_buckets(specs, bucket_cap_bytes=cap, first_bucket_cap_bytes=cap)
    try:
        expected = torch_bucket_assignment(plan, world_size, shard_buckets)
    except AssertionError as e:  # torch: "All indices are disallowed"
        with pytest.raises(ValueError, match="more than world_size"):
            assign_buckets(plan, world_size, shard_buckets=shard_buckets)
        assert "disallowed" in str(e)
        return
    ours = assign_buckets(plan, world_size, shard_buckets=shard_buckets)
    got = [sorted((s.bucket, s.start, list(plan.buckets[s.bucket].members[s.start:s.stop])) for s in rank)
           for rank in ours.per_rank]
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 5), sizes=st.lists(st.integers(0, 50), min_size=0, max_size=12))
def test_broadcast_order_is_every_rank_lightest_share_first(world_size, sizes):
    # Not torch's (it broadcasts in rank order): every rank must derive the same permutation.
    _, partition = hybrid_partition([sizes], world_size)
    order = partition.broadcast_order()
    loads = partition.numel_per_rank()
    assert sorted(order) == list(range(world_size))
    assert [(loads[r], r) for r in order] == sorted((loads[r], r) for r in range(world_size))
