"""hybrid.torch.DistributedDataParallel used as torch users use torch's class (issue 15): pickled
and copied, accumulating with no_sync, set static late, with built-in hooks. Each case runs under
torch's DDP and ours in the same gloo processes, world sizes 1, 2, 3."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _workers_habits  # noqa: E402
from test_ddp import WORLD_SIZES, LazyWorlds, close_nested as _close, side_by_side_results as _results  # noqa: E402
from test_ddp_logging import assert_like_torch as assert_logging_like_torch  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return LazyWorlds(_workers_habits.habits_worker, _workers_habits.CASES, "habits")


PICKLE_CASES = sorted(c for c in _workers_habits.CASES
                      if c.startswith("pickle_") and c not in ("pickle_subgroup", "pickle_rewrap_mlp_static"))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", PICKLE_CASES)
def test_pickled_model_trains_on_like_torch(runs, world, case):
    # torch.save / torch.load, pickle and deepcopy of the wrapped model: the copy has a fresh
    # reducer on the default group and trains on; its gradients and parameters equal torch's.
    # With static_graph, torch 2.13's copy never reduces again (its __dict__ carries
    # _static_graph_delay_allreduce_enqueued=True, so its first iteration's delayed all-reduce is
    # never queued): ours is compared with torch's class wrapped anew around a copy of the module.
    reference = "pickle_rewrap_mlp_static" if case.endswith("_static") else case
    for (_, ours), (ref, _) in zip(_results(runs, world, case), _results(runs, world, reference)):
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ref["params"])
        _close(ours["original"], ref["original"])
    if case.endswith("_static") and world > 1:  # the torch bug described above, still there
        torch_grads = [res[case]["torch"]["result"]["grads"][0][0] for res in runs[world]]
        assert not torch.equal(torch_grads[0], torch_grads[1])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_pickle_needs_the_default_group_like_torch(runs, world):
    for res in runs[world]:
        ref, ours = res["pickle_subgroup"]["torch"], res["pickle_subgroup"]["hybrid"]
        assert ref["error"][0] == ours["error"][0] == "RuntimeError", (ref, ours)
        assert "only supported when using DDP with the default process group" in ours["error"][1]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["no_sync_unused", "no_sync_unused_view"])
def test_no_sync_counts_a_parameter_used_in_any_micro_batch(runs, world, case):
    # torch's locally-used map accumulates over the no_sync() window until the synchronizing
    # backward: ``sometimes``, used on rank 0 inside no_sync() only, is reduced and every rank ends
    # with the same gradient for it; ``never`` stays None everywhere.
    results = _results(runs, world, case)
    for ref, ours in results:
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ref["params"])
    first = results[0][1]["grads"]
    for _, ours in results[1:]:
        _close(ours["grads"], first)
    names = [n for n, _ in _workers_habits.Unused().named_parameters()]
    last = dict(zip(names, first[-1]))
    assert last["never.weight"] is None and last["sometimes.weight"] is not None


def _outcomes(runs, world, case):
    """(torch's, ours) raw outcome (result or error, and warnings) on every rank."""
    return [(res[case]["torch"], res[case]["hybrid"]) for res in runs[world]]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["static_late_mlp", "static_late_unused", "static_late_find_unused"])
def test_set_static_graph_after_construction_like_torch(runs, world, case):
    # ddp._set_static_graph() before the first forward trains as static_graph=True does.
    for ref, ours in _results(runs, world, case):
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ref["params"])
    for ref, ours in _outcomes(runs, world, case):
        assert ours["warnings"] == ref["warnings"]  # find_unused_parameters: torch's warning
    if case != "static_late_mlp":
        for (_, late), (ref, _) in zip(_results(runs, world, case), _results(runs, world, "static_late_reference")):
            _close(late["params"], ref["params"])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_set_static_graph_rules_like_torch(runs, world):
    for ref, ours in _outcomes(runs, world, "static_late_after_training"):
        assert ours["error"] == ref["error"] and ref["error"][0] == "RuntimeError", (ours, ref)
    for ref, ours in _outcomes(runs, world, "static_twice"):
        assert ours["warnings"] == ref["warnings"] == ["You've set static_graph to be True, no need to set it again."]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["builtin_ALLREDUCE", "builtin_FP16_COMPRESS", "skip_unused", "skip_unused_view",
                                  "skip_unused_buckets", "skip_unused_buckets_view"])
def test_builtin_comm_hooks_and_skip_unused_like_torch(runs, world, case):
    # _register_builtin_comm_hook(ALLREDUCE / FP16_COMPRESS); skip_all_reduce_unused_params=True
    # with the same parameters unused on every rank (torch's requirement for it).
    for ref, ours in _results(runs, world, case):
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ref["params"])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_skipped_buckets_under_join_like_torch_without_skip(runs, world):
    # skip_all_reduce_unused_params under join(): the joined ranks skip the buckets the others
    # skip (torch's do not, so they cannot train so); the result is torch's without the skip.
    for (ours,), (ref,) in zip(_results(runs, world, "join_skip_unused", labels=("hybrid",)),
                               _results(runs, world, "join_unused", labels=("torch",))):
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ref["params"])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_will_sync_module_buffers_like_torch(runs, world):
    # torch syncs buffers at a forward only when the previous forward was a synchronizing one:
    # not after a no_sync() forward nor after a no_grad (eval) forward.
    for ref, ours in _results(runs, world, "will_sync"):
        assert ours["seen"] == ref["seen"]
        _close(ours["buffers"], ref["buffers"])
        _close(ours["params"], ref["params"])


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["logging", "logging_defaults"])
def test_logging_data_keys_like_torch(runs, world, case):
    # torch's keys, each with torch's value (timings: positive where torch's are), before and
    # after training (rebuilt_bucket_sizes: the buckets rebuilt after the first iteration).
    for ref, ours in _results(runs, world, case):
        for when in ("before", "after"):
            assert_logging_like_torch(ours[when], ref[when], when)
