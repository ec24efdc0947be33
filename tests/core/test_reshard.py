"""reshard: any layout of the same tensors into any other, checked against pack + take_shard."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import TensorSpec, pack, plan_buckets, rebuild_plan, reshard, shard_flat, take_shard

from tests.core.strategies import spec_lists


def _slices(shards, arrays):
    """Every rank's slices of every bucket, built the direct way (pack, pad, slice)."""
    plan = shards.bucket_plan
    return [[take_shard(shards, b, r, pack(plan, b, arrays, length=shards.padded_length(b)))
             for b in range(plan.num_buckets)] for r in range(shards.world_size)]


@st.composite
def layouts(draw):
    """Two layouts of the same float64 tensors: caps, member order, alignment, world size differ."""
    specs = draw(spec_lists(keys=[("float64", "cpu")], max_size=20, max_numel=60, sparse=False))
    def one():
        caps = draw(st.sampled_from([[1 << 40], [64], [200, 400], [8, 96]]))
        plan = plan_buckets(specs, size_limits=caps, alignment=draw(st.sampled_from([1, 1, 4])))
        if draw(st.booleans()):  # DDP's rebuild from a gradient-ready order: other member order
            order = draw(st.permutations(range(len(specs))))
            plan = rebuild_plan(plan, order, size_limits=caps)
        return shard_flat(plan, draw(st.integers(1, 5)))
    return specs, one(), one()


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 1 << 16))
def test_reshard_equals_direct_slicing(case, seed):
    specs, src, dst = case
    arrays = [np.arange(s.numel, dtype=np.float64).reshape(s.shape) + 1000.0 * i + 1 for i, s in enumerate(specs)]
    got_src = _slices(src, arrays)
    want = _slices(dst, arrays)
    plan = reshard(src, dst)
    for r in range(dst.world_size):
        got = plan.gather(r, lambda sr, sb, lo, hi: got_src[sr][sb][lo:hi])
        for b in range(dst.bucket_plan.num_buckets):
            np.testing.assert_array_equal(got[b], want[r][b])  # padding included: zero on both
        # Every element that some copy writes is written once.
        for b in range(dst.bucket_plan.num_buckets):
            covered = np.zeros(dst.shard_sizes[b], dtype=int)
            for c in plan.copies(r):
                if c.dst_bucket == b:
                    covered[c.dst_start:c.dst_start + c.length] += 1
            assert covered.max(initial=0) <= 1
        assert set(plan.sources(r)) <= set(range(src.world_size))
        # Copies never run past a slice on either side.
        for c in plan.copies(r):
            assert c.src_start + c.length <= src.shard_sizes[c.src_bucket]
            assert c.dst_start + c.length <= dst.shard_sizes[c.dst_bucket]


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_same_layout_is_one_copy_per_nonempty_slice_run(case):
    _, src, _ = case
    plan = reshard(src, src)
    for r in range(src.world_size):
        assert all(c.src_rank == r and c.src_bucket == c.dst_bucket and c.src_start == c.dst_start
                   for c in plan.copies(r))
        if src.bucket_plan.alignment == 1:
            assert len({c.dst_bucket for c in plan.copies(r)}) == len(plan.copies(r))


def test_reshard_names_the_tensor_that_differs():
    a = plan_buckets([TensorSpec("w", (4,), "float32"), TensorSpec("b", (2,), "float32")])
    b = plan_buckets([TensorSpec("w", (2, 2), "float32"), TensorSpec("b", (2,), "float32")])
    with pytest.raises(ValueError, match=r"'w' is float32\[4\] in the source and float32\[2, 2\]"):
        reshard(shard_flat(a, 1), shard_flat(b, 1))
    c = plan_buckets([TensorSpec("w", (4,), "float32"), TensorSpec("bias", (2,), "float32")])
    with pytest.raises(ValueError, match=r"only in the destination: \['bias'\], only in the source: \['b'\]"):
        reshard(shard_flat(a, 2), shard_flat(c, 2))
