"""plan_graph_split: every parameter in exactly one piece, monotone boundaries, caps respected,
and on one-parameter nodes exactly the reducer's rebuilt buckets (torch's bucket rule)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import (GraphSplitPlan, TensorSpec, merge_piece, plan_buckets, plan_graph_split, rebuild_plan,
                         split_size_limits)

from .strategies import spec_lists


@st.composite
def grouped(draw, keys=None):
    """Specs, a drawn ready order cut into node groups, and size limits."""
    specs = draw(spec_lists(max_size=25, sparse=False, keys=keys))
    order = draw(st.permutations(range(len(specs))))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=len(order))))
    cuts = [c for c in cuts if 0 < c < len(order)]
    groups = [tuple(order[a:b]) for a, b in zip([0] + cuts, cuts + [len(order)])]
    limits = tuple(draw(st.lists(st.integers(0, 3000), min_size=1, max_size=3)))
    return specs, groups, limits


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_split_invariants(case):
    specs, groups, limits = case
    plan = plan_graph_split(specs, groups, size_limits=limits)
    members = [i for k in range(plan.num_pieces) for i in plan.members(k)]
    assert sorted(members) == list(range(len(specs)))              # each parameter in exactly one piece
    assert members == [i for g in groups for i in g]                # pieces follow the ready order
    assert list(plan.starts) == sorted(set(plan.starts)) and plan.starts[0] == 0   # monotone
    owner = plan.piece_of_group()
    assert list(owner) == sorted(owner) and len(owner) == len(groups)
    for k in range(plan.num_pieces):
        last = plan.piece_groups(k)[-1]
        before_last = plan.nbytes(k) - sum(specs[i].nbytes for i in groups[last])
        assert before_last < plan.limit(k) or len(plan.piece_groups(k)) == 1   # closed as soon as full
        if k + 1 < plan.num_pieces:
            assert plan.nbytes(k) >= plan.limit(k)                      # ... and not before
    assert GraphSplitPlan.from_json(plan.to_json()) == plan
    assert GraphSplitPlan.from_json(plan.to_json()).fingerprint() == plan.fingerprint()


@settings(max_examples=200, deadline=None)
@given(grouped(keys=[("float32", "cpu")]), st.data())
def test_one_parameter_nodes_give_the_reducers_rebuilt_buckets(case, data):
    specs, _, limits = case
    order = data.draw(st.permutations(range(len(specs))))
    split = plan_graph_split([specs[i] for i in order], size_limits=limits)
    rebuilt = rebuild_plan(plan_buckets(specs, size_limits=[1 << 40]), order, size_limits=limits)
    pieces = [[order[i] for i in split.members(k)] for k in range(split.num_pieces)]
    assert pieces == rebuilt.bucket_indices()


@settings(max_examples=100, deadline=None)
@given(grouped(), st.data())
def test_merge_keeps_every_parameter_once(case, data):
    specs, groups, limits = case
    plan = plan_graph_split(specs, groups, size_limits=limits)
    k = data.draw(st.integers(0, plan.num_pieces - 1))
    merged = merge_piece(plan, k)
    assert merged.num_pieces == max(1, plan.num_pieces - 1)
    assert [i for j in range(merged.num_pieces) for i in merged.members(j)] == [i for g in groups for i in g]
    if plan.num_pieces > 1:
        assert len(merged.merged) == 1 and merged.merged[0] in plan.starts


def test_cap_below_every_parameter_gives_one_piece_per_node():
    specs = [TensorSpec(f"p{i}", (64,), "float32") for i in range(4)]
    plan = plan_graph_split(specs, [(0, 1), (2,), (3,)], size_limits=split_size_limits(1))
    assert [plan.members(k) for k in range(plan.num_pieces)] == [(0, 1), (2,), (3,)]


def test_no_parameters_no_pieces():
    assert plan_graph_split([], []).num_pieces == 0


@pytest.mark.parametrize("call, match", [
    (lambda: split_size_limits(-1), "non-negative, got -1"),
    (lambda: split_size_limits(100, 200), "between 0 and the cap \\(100\\), got 200"),
    (lambda: plan_graph_split([TensorSpec("a", (1,), "float32")], [(0,), (0,)]), "exactly one group"),
    (lambda: plan_graph_split([TensorSpec("a", (1,), "float32")], [(1,)]), "exactly one group"),
    (lambda: merge_piece(plan_graph_split([TensorSpec("a", (1,), "float32")]), 3), "piece 3"),
])
def test_invalid_input_names_the_culprit(call, match):
    with pytest.raises(ValueError, match=match):
        call()
