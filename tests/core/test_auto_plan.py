"""hybrid.core.auto_plan: bucket boundaries from the cost model (issue 25.2), against brute force.

predict_step is the model (docs/core.md); auto_plan must find the plan it says ends soonest. On
small cases every contiguous cut of the ready order (and, with in_place, every one-tensor bucket
reduced where it lies) is tried: the planner's value must equal the best one to 1e-12 relative
(float sums in another order, nothing more).
"""

import itertools
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import (Bucket, BucketPlan, CopyCost, CostModel, TensorSpec, auto_plan, plan_buckets, predict_step,
                         ready_times_by_elements, rebuild_plan)
from hybrid.core._buckets import _layout
from hybrid.core.cost._auto import EXACT_TENSORS, atoms

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)


def model(latency=1e-4, per_byte=1e-9, overlap=0.5, world=2, lost_after_small=0.0):
    """A synthetic measured group: alpha-beta times, trains overlapping ``overlap`` of the latency;
    behind a small collective a big one loses ``lost_after_small`` of that overlap (mixed trains)."""
    kinds = ("all_reduce", "broadcast")
    alone = {n: latency + n * per_byte for n in SIZES}
    gap = {n: latency * (1 - overlap) + n * per_byte for n in SIZES}
    after_small = {n: gap[n] + lost_after_small * latency * overlap for n in SIZES}
    samples = [(k, n, alone[n]) for k in kinds for n in SIZES]
    trains = [(k, n, 4, alone[n] + 3 * gap[n]) for k in kinds for n in SIZES]
    mixed = [(k, n, 4, alone[n] + 3 * (after_small[n] + gap[SIZES[0]])) for k in kinds for n in SIZES[1:]]
    return CostModel.fit(samples, trains=trains, mixed=mixed, world_size=world)


def all_plans(specs, order, in_place):
    """Every contiguous cut of ``order`` into buckets, singles in place or not."""
    n = len(order)
    for cuts in itertools.product((False, True), repeat=n - 1):
        runs, start = [], 0
        for k, cut in enumerate(cuts, 1):
            if cut:
                runs.append(order[start:k])
                start = k
        runs.append(order[start:])
        buckets = [_layout(specs, r, 0, 1) for r in runs]
        singles = [k for k, r in enumerate(runs) if len(r) == 1] if in_place else []
        for flags in itertools.product((False, True), repeat=len(singles)):
            out = list(buckets)
            for k, f in zip(singles, flags):
                out[k] = Bucket(**{**{f: getattr(out[k], f) for f in Bucket.__slots__}, "in_place": f})
            yield BucketPlan(tuple(specs), tuple(out), (1,))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_auto_plan_is_the_best_plan_of_its_model(data):
    n = data.draw(st.integers(1, 7))
    specs = [TensorSpec(f"t{i}", (data.draw(st.sampled_from([64, 1024, 16384, 262144, 1 << 20])),), "float32")
             for i in range(n)]
    order = data.draw(st.permutations(range(n)))
    gaps = sorted(data.draw(st.lists(st.floats(0, 2e-3), min_size=n, max_size=n)))
    ready = list(itertools.accumulate(gaps))
    cost = model(latency=data.draw(st.sampled_from([1e-5, 1e-4, 1e-3])),
                 overlap=data.draw(st.sampled_from([0.0, 0.5, 0.9])),
                 lost_after_small=data.draw(st.sampled_from([0.0, 0.5, 1.0])))
    copy = CopyCost(data.draw(st.sampled_from([0.0, 1e-10, 1e-9])), data.draw(st.sampled_from([0.0, 2e-5, 3e-4])))
    in_place = data.draw(st.booleans())
    after = data.draw(st.sampled_from([(), (("broadcast", 2),)]))
    kw = dict(copy=copy, after_step=after, backward_s=ready[-1] + data.draw(st.sampled_from([0.0, 1e-3])),
              overlap=data.draw(st.sampled_from([1.0, 0.5, 0.0])))
    plan = auto_plan(specs, order, ready, cost, in_place=in_place, **kw)
    got = predict_step(plan, order, ready, cost, **kw).end_s
    best = min(predict_step(p, order, ready, cost, **kw).end_s for p in all_plans(specs, order, in_place)
               if all(len(b.members) == 1 or b.nbytes <= SIZES[-1] for b in p.buckets))  # none past what was measured
    assert got == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert all(b.in_place == (in_place and len(b.members) == 1) for b in plan.buckets)
    assert all(len(b.members) == 1 or b.nbytes <= SIZES[-1] for b in plan.buckets)


def _mlp(widths):
    return [s for i, (a, b) in enumerate(zip(widths, widths[1:]))
            for s in (TensorSpec(f"{i}.weight", (b, a), "float32"), TensorSpec(f"{i}.bias", (b,), "float32"))]


@pytest.mark.parametrize("specs", [_mlp([2048] * 6), _mlp([32] * 101), _mlp([1536, 2048, 1024, 1536, 768])],
                         ids=["mlp_21M", "small_x200", "zero_mlp"])
@pytest.mark.parametrize("in_place", [True, False])
def test_auto_never_predicts_worse_than_torchs_default_caps(specs, in_place):
    # torch's rebuilt buckets are one of the cuts the planner weighs: it can only do as well or better
    order = list(reversed(range(len(specs))))
    ready = ready_times_by_elements(specs, order, 0.05)
    cost, copy = model(), CopyCost(2e-10, 3e-5)
    default = rebuild_plan(plan_buckets(specs), order)
    auto = auto_plan(specs, order, ready, cost, copy=copy, in_place=in_place)
    a = predict_step(auto, order, ready, cost, copy=copy)
    d = predict_step(default, order, ready, cost, copy=copy)
    assert a.end_s <= d.end_s * (1 + 1e-12)
    assert sorted(m for b in auto.buckets for m in b.members) == list(range(len(specs)))
    if len(specs) <= EXACT_TENSORS:  # one dtype: the caps reproduce the plan through torch's rebuild
        again = rebuild_plan(plan_buckets(specs, size_limits=[1 << 60]), order, size_limits=auto.size_limits)
        assert again.bucket_indices() == auto.bucket_indices()


def test_more_latency_never_means_more_buckets():
    specs = _mlp([256] * 9)
    order = list(reversed(range(len(specs))))
    ready = ready_times_by_elements(specs, order, 0.01)
    counts = [auto_plan(specs, order, ready, model(latency=a), copy=CopyCost(1e-10)).num_buckets
              for a in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts


def test_big_gradients_skip_the_copy_and_simultaneous_small_ones_share_a_bucket():
    big = [TensorSpec(f"w{i}", (1 << 22,), "float32") for i in range(3)]  # 16 MiB each
    plan = auto_plan(big, [2, 1, 0], [0.01, 0.02, 0.03], model(), copy=CopyCost(2e-10))
    assert plan.bucket_indices() == [[2], [1], [0]] and all(b.in_place for b in plan.buckets)
    small = [TensorSpec(f"b{i}", (32,), "float32") for i in range(6)]
    assert auto_plan(small, range(6), [0.0] * 6, model(), copy=CopyCost(1e-10, 1e-5)).num_buckets == 1


def test_sparse_and_other_dtypes_get_their_own_buckets():
    specs = [TensorSpec("e", (100, 8), "float32", sparse=True), TensorSpec("h", (64,), "float16"),
             TensorSpec("w", (64,), "float32"), TensorSpec("v", (64,), "float32")]
    plan = auto_plan(specs, [3, 2, 1, 0], [0.0, 0.0, 0.0, 0.0], model(), copy=CopyCost(1e-10))
    keys = [{(specs[m].dtype, specs[m].sparse) for m in b.members} for b in plan.buckets]
    assert all(len(k) == 1 for k in keys) and {("float32", True)} in keys
    assert not any(b.in_place for b in plan.buckets if b.sparse)


def test_atoms_bound_the_search_and_keep_big_tensors_alone():
    sizes = [4096] * 300 + [1 << 24] + [4096] * 300
    runs = atoms(sizes)
    assert len(runs) <= 130 and (300, 301) in runs
    assert [k for r in runs for k in range(*r)] == list(range(len(sizes)))


def test_in_place_buckets_round_trip_and_leave_other_fingerprints_alone():
    specs = [TensorSpec("w", (8,), "float32"), TensorSpec("b", (2,), "float32")]
    plain = plan_buckets(specs)
    assert "in_place" not in json.dumps(plain.to_json())  # old plans, old fingerprints
    auto = auto_plan(specs, [1, 0], [0.0, 1.0], model(latency=1e-7), copy=CopyCost(1e-6))
    assert any(b.in_place for b in auto.buckets)
    again = BucketPlan.from_json(auto.dumps())
    assert again == auto and again.fingerprint() == auto.fingerprint() != plain.fingerprint()
    with pytest.raises(ValueError, match="in-place bucket holds one dense tensor"):
        Bucket("float32", "cpu", (0, 1), (0, 8), (8, 2), 10, 40, in_place=True)


@pytest.mark.parametrize("args,message", [
    (([1, 1], [0.0, 0.0]), "ready_order must name each"),
    (([1, 0], [0.0]), "ready_s must hold 2"),
    (([1, 0], [0.0, -1.0]), "ready_s must hold 2"),
])
def test_auto_plan_refuses_bad_input(args, message):
    specs = [TensorSpec("w", (8,), "float32"), TensorSpec("b", (2,), "float32")]
    with pytest.raises(ValueError, match=message):
        auto_plan(specs, *args, model())
    with pytest.raises(ValueError, match="seconds_per_byte"):
        CopyCost(-1.0)
    with pytest.raises(ValueError, match="after_step parts"):
        auto_plan(specs, [1, 0], [0.0, 0.0], model(), after_step=[("broadcast", 0)])


_PLAN_IN_A_PROCESS = """
import sys
from hybrid.core import CopyCost, CostModel, TensorSpec, auto_plan, ready_times_by_elements
specs = [TensorSpec(f"{i}.{k}", (s,) if k == "bias" else (s, s), "float32")
         for i, s in enumerate([32, 64, 512, 1024] * 12) for k in ("weight", "bias")]
order = list(reversed(range(len(specs))))
samples = [("all_reduce", n, 1e-4 + n * 1.3e-9) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
trains = [("all_reduce", n, 4, 2.6e-4 + 4 * n * 1.3e-9) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
model = CostModel.fit(samples, trains=trains, world_size=3)
plan = auto_plan(specs, order, ready_times_by_elements(specs, order, 0.02), model, copy=CopyCost(2e-10, 3e-5))
print(plan.fingerprint(), plan.num_buckets)
"""


def test_every_process_plans_the_same_buckets():
    # ranks plan from the same agreed inputs: the plan, hence its fingerprint, must not depend on
    # anything else a process holds (hash seeds, dict orders)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = {subprocess.run([sys.executable, "-c", _PLAN_IN_A_PROCESS], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": seed}).stdout
            for seed in ("0", "1", "12345")}
    assert len(outs) == 1 and int(outs.pop().split()[1]) > 1
