"""Properties of BucketPlan, FlatShardPlan, and pack/unpack on every array kind."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import (BucketPlan, FlatShardPlan, TensorSpec, assign_buckets, bucket_pieces, pack, plan_buckets,
                         rebuild_plan, shard_flat, take_shard, unpack)

from .strategies import spec_lists

dense_specs = spec_lists(max_size=30, sparse=False)
float_specs = spec_lists(max_size=20, sparse=False, keys=[("float32", "cpu"), ("float64", "cpu"), ("int32", "cpu")])


def check_plan_invariants(plan: BucketPlan):
    placed = [m for b in plan.buckets for m in b.members]
    assert sorted(placed) == list(range(len(plan.specs)))  # every tensor exactly once
    for b in plan.buckets:
        assert {(plan.specs[m].dtype, plan.specs[m].device) for m in b.members} == {(b.dtype, b.device)}
        ends = [o + n for o, n in zip(b.offsets, b.numels)]
        assert all(o >= e for o, e in zip(b.offsets[1:], ends))  # no overlap, in order
        assert b.length >= ends[-1] and b.length % plan.alignment == 0
        assert all(o % plan.alignment == 0 for o in b.offsets)
        nbytes = sum(plan.specs[m].nbytes for m in b.members)
        last = plan.specs[b.members[-1]].nbytes
        # Caps hold except that the tensor that crosses a cap closes its bucket.
        assert nbytes - last < b.size_limit or len(b.members) == 1 or b.size_limit == 0


@settings(max_examples=150, deadline=None)
@given(specs=dense_specs, cap=st.integers(1, 3000), first=st.integers(1, 3000), alignment=st.sampled_from([1, 2, 4, 16]))
def test_plan_buckets_invariants(specs, cap, first, alignment):
    plan = plan_buckets(specs, bucket_cap_bytes=cap, first_bucket_cap_bytes=first, alignment=alignment)
    check_plan_invariants(plan)
    # Registration order is preserved inside buckets; buckets run from last-registered to first.
    for b in plan.buckets:
        assert list(b.members) == sorted(b.members)
    firsts = [b.members[0] for b in plan.buckets]
    assert firsts == sorted(firsts, reverse=True)


@settings(max_examples=100, deadline=None)
@given(specs=dense_specs, data=st.data())
def test_rebuild_follows_ready_order(specs, data):
    plan = plan_buckets(specs)
    order = data.draw(st.permutations(range(len(specs))))
    rebuilt = rebuild_plan(plan, order, size_limits=[data.draw(st.integers(1, 2000))])
    check_plan_invariants(rebuilt)
    for b in rebuilt.buckets:  # members keep the ready order within each bucket
        positions = [order.index(m) for m in b.members]
        assert positions == sorted(positions)


@settings(max_examples=100, deadline=None)
@given(specs=dense_specs, world_size=st.integers(1, 9), cap=st.integers(1, 3000))
def test_flat_shards_tile_each_bucket(specs, world_size, cap):
    plan = plan_buckets(specs, bucket_cap_bytes=cap, first_bucket_cap_bytes=cap)
    shards = shard_flat(plan, world_size)
    for b, bucket in enumerate(plan.buckets):
        ranges = [shards.shard_range(b, r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == shards.padded_length(b)
        assert all(r1[1] == r2[0] for r1, r2 in zip(ranges, ranges[1:]))
        assert shards.padded_length(b) - bucket.length < world_size  # under one element per rank
        covered = {}
        for r in range(world_size):
            for s in shards.member_slices(b, r):
                covered.setdefault(s.tensor, []).append((s.start, s.stop))
        for m, n in zip(bucket.members, bucket.numels):
            pieces = sorted(covered.get(m, []))
            assert sum(hi - lo for lo, hi in pieces) == n
            assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))


@settings(max_examples=100, deadline=None)
@given(specs=dense_specs, world_size=st.integers(1, 5), cap=st.integers(1, 3000), alignment=st.sampled_from([1, 4]),
       data=st.data())
def test_group_runs_tile_each_slice_by_group(specs, world_size, cap, alignment, data):
    # Brute force: label every element of the padded bucket with its owner's group (gaps and
    # padding go to the member before them), then read each rank's slice run by run.
    plan = plan_buckets(specs, bucket_cap_bytes=cap, first_bucket_cap_bytes=cap, alignment=alignment)
    shards = shard_flat(plan, world_size)
    group_of = data.draw(st.lists(st.integers(0, 2), min_size=len(specs), max_size=len(specs)))
    for rank in range(world_size):
        runs = shards.group_runs(rank, group_of)
        for b, bucket in enumerate(plan.buckets):
            label = [None] * shards.padded_length(b)
            for i, (m, o) in enumerate(zip(bucket.members, bucket.offsets)):
                end = bucket.offsets[i + 1] if i + 1 < len(bucket.members) else len(label)
                label[(0 if i == 0 else o):end] = [group_of[m]] * (end - (0 if i == 0 else o))
            start, stop = shards.shard_range(b, rank)
            mine = [(r.lo, r.hi, r.group) for r in runs if r.bucket == b]
            if stop == start:  # an empty bucket (zero-size tensors) has empty slices: no runs
                assert mine == []
                continue
            assert mine[0][0] == 0 and mine[-1][1] == stop - start
            assert all(p[1] == q[0] and p[2] != q[2] for p, q in zip(mine, mine[1:]))  # maximal
            for lo, hi, g in mine:
                assert label[start + lo:start + hi] == [g] * (hi - lo)


def test_group_runs_needs_one_group_per_spec():
    shards = shard_flat(plan_buckets([TensorSpec("a", (4,), "float32")]), 2)
    with pytest.raises(ValueError, match="one group per spec"):
        shards.group_runs(0, [0, 1])


def _arrays(specs, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s.shape).astype(s.dtype) if s.dtype != "int32"
            else rng.integers(-100, 100, s.shape).astype(np.int32) for s in specs]


@settings(max_examples=60, deadline=None)
@given(specs=float_specs, alignment=st.sampled_from([1, 3, 8]), world_size=st.integers(1, 5), seed=st.integers(0, 99))
def test_pack_unpack_identity_numpy(specs, alignment, world_size, seed):
    plan = plan_buckets(specs, bucket_cap_bytes=256, first_bucket_cap_bytes=64, alignment=alignment)
    shards = shard_flat(plan, world_size)
    arrays = _arrays(specs, seed)
    for b in range(plan.num_buckets):
        flat = pack(plan, b, arrays, length=shards.padded_length(b))
        buffer = np.zeros_like(flat)
        assert pack(plan, b, arrays, length=shards.padded_length(b), out=buffer) is buffer
        np.testing.assert_array_equal(buffer, flat)  # into a zeroed buffer: the same bytes, padding too
        for m, out in unpack(plan, b, flat).items():
            np.testing.assert_array_equal(out, arrays[m])  # exact: pure data movement
        cuts = bucket_pieces(plan, b, length=shards.padded_length(b))
        assert sum(n for _, n in cuts) == len(flat)
        for (m, _), part in zip(cuts, np.split(flat, np.cumsum([n for _, n in cuts])[:-1])):
            np.testing.assert_array_equal(part, np.zeros_like(part) if m is None else arrays[m].reshape(-1))
        pieces = [take_shard(shards, b, r, flat) for r in range(world_size)]
        np.testing.assert_array_equal(np.concatenate(pieces), flat)
        for r in range(world_size):
            for s in shards.member_slices(b, r):
                np.testing.assert_array_equal(pieces[r][s.shard_offset:s.shard_offset + s.stop - s.start],
                                              arrays[s.tensor].reshape(-1)[s.start:s.stop])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_pack_unpack_identity_frameworks(framework):
    specs = [TensorSpec("a", (3, 4), "float32"), TensorSpec("b", (5,), "float32"), TensorSpec("c", (2, 2), "float32")]
    plan = plan_buckets(specs, alignment=4)
    arrays = _arrays(specs, 0)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        converted = [torch.from_numpy(a) for a in arrays]
        to_numpy = lambda x: x.numpy()  # noqa: E731
    else:
        jnp = pytest.importorskip("jax.numpy")
        converted = [jnp.asarray(a) for a in arrays]
        to_numpy = np.asarray
    flat = pack(plan, 0, converted)
    assert type(flat).__module__.split(".")[0] == type(converted[0]).__module__.split(".")[0]
    np.testing.assert_array_equal(to_numpy(flat), pack(plan, 0, arrays))  # same layout as numpy
    # Into a stale buffer of the framework's kind: members overwritten, padding left as it was.
    stale = np.full(plan.buckets[0].length, 7.0, np.float32)
    want = stale.copy()
    for m, o, n in zip(plan.buckets[0].members, plan.buckets[0].offsets, plan.buckets[0].numels):
        want[o:o + n] = arrays[m].reshape(-1)
    buffer = torch.from_numpy(stale.copy()) if framework == "torch" else jnp.asarray(stale)
    written = pack(plan, 0, converted, out=buffer)
    assert framework == "jax" or written is buffer  # torch writes in place
    np.testing.assert_array_equal(to_numpy(written), want)
    for m, out in unpack(plan, 0, flat).items():
        np.testing.assert_array_equal(to_numpy(out), arrays[m])


def test_pack_rejects_wrong_shape_naming_the_tensor():
    plan = plan_buckets([TensorSpec("layer.weight", (2, 3), "float32")])
    with pytest.raises(ValueError, match="layer.weight"):
        pack(plan, 0, [np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError, match="layer.weight"):
        pack(plan, 0, [np.zeros((3, 2), np.float32)], out=np.zeros(6, np.float32))


@pytest.mark.parametrize("out", [np.zeros(5, np.float32), np.zeros(6, np.float64), np.zeros((2, 3), np.float32)])
def test_pack_rejects_wrong_out_buffer(out):
    plan = plan_buckets([TensorSpec("layer.weight", (2, 3), "float32")])
    with pytest.raises(ValueError, match=r"packs into a float32\[6\] buffer"):
        pack(plan, 0, [np.zeros((2, 3), np.float32)], out=out)


@settings(max_examples=50, deadline=None)
@given(specs=dense_specs, world_size=st.integers(1, 4))
def test_plans_round_trip_json_and_hash(specs, world_size):
    plan = plan_buckets(specs, bucket_cap_bytes=512, first_bucket_cap_bytes=128)
    again = BucketPlan.from_json(json.loads(plan.dumps()))
    assert again == plan and hash(again) == hash(plan) and again.fingerprint() == plan.fingerprint()
    shards = shard_flat(plan, world_size)
    assert FlatShardPlan.from_json(json.loads(json.dumps(shards.to_json()))) == shards
    assignment = assign_buckets(plan, world_size, shard_buckets=False)
    assert type(assignment).from_json(json.loads(json.dumps(assignment.to_json()))) == assignment


def test_fingerprint_is_the_same_in_another_process():
    specs = [TensorSpec(f"p{i}", (i + 1, 7), "bfloat16" if i % 2 else "float32") for i in range(20)]
    plan = plan_buckets(specs, bucket_cap_bytes=300, first_bucket_cap_bytes=100)
    code = ("import json,sys; from hybrid.core import BucketPlan; "
            "print(BucketPlan.from_json(json.loads(sys.stdin.read())).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], input=plan.dumps(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == plan.fingerprint()
    other = plan_buckets(specs, bucket_cap_bytes=301, first_bucket_cap_bytes=100)
    assert other.fingerprint() != plan.fingerprint() or other == plan


def test_core_imports_neither_torch_nor_jax():
    code = "import sys, hybrid.core; bad = {'torch', 'jax', 'jaxlib'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("call, match", [
    (lambda: plan_buckets([TensorSpec("a", (1,), "float32")], bucket_cap_bytes=-5), "bucket_cap_bytes.*-5"),
    (lambda: plan_buckets([TensorSpec("a", (1,), "float32")], alignment=0), "alignment.*0"),
    (lambda: plan_buckets([TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "float32")]), "duplicate tensor name 'a'"),
    (lambda: shard_flat(plan_buckets([TensorSpec("a", (1,), "float32")]), 0), "world_size.*0"),
    (lambda: TensorSpec("v", (1,), np.dtype("V0")), "zero size"),
    (lambda: TensorSpec("v", (1,), "float17"), "unknown dtype 'float17'"),
    (lambda: TensorSpec("v", (-1,), "float32"), "'v'.*non-negative"),
    (lambda: rebuild_plan(plan_buckets([TensorSpec("a", (1,), "float32")]), [0, 0]), "distinct"),
])
def test_invalid_input_raises_value_error_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call()
