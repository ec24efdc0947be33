"""hybrid.torch.DistributedDataParallel against torch's own DDP, multi-process gloo, world 1/2/3."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _workers  # noqa: E402
import _workers_errors  # noqa: E402

from tests._procs import forkserver_context, free_port  # noqa: E402
from hybrid.core._reducer_state import mark_ready, mark_unused, start_iteration  # noqa: E402
from hybrid.core import TensorSpec, plan_buckets  # noqa: E402

# float32, same framework, same bucket layout and the same gloo reduction: torch's oracle and ours
# usually agree bit for bit; the tolerance is the project's float32 budget (a reordering of one
# division, e.g. static_graph's delayed first reduction, stays far below it).
RTOL, ATOL = 1.3e-6, 1e-6
WORLD_SIZES = (1, 2, 3)


def _spawn(fn, world, *args):
    """``fn(rank, world, port, outdir, *args)`` on ``world`` ranks forked from the preloaded
    forkserver (tests/_procs.py); returns ``outdir``, where the ranks saved their results."""
    outdir = tempfile.mkdtemp(prefix="hybrid_ddp_")
    forkserver_context()  # sets the server's preload before its first start
    mp.start_processes(fn, args=(world, free_port(), outdir, *args), nprocs=world, join=True,
                       start_method="forkserver")
    return outdir


def _spawn_into(outdir, fn, world):
    forkserver_context()
    mp.start_processes(fn, args=(world, free_port(), outdir), nprocs=world, join=True, start_method="forkserver")


def close_nested(a, b):
    """``a`` and ``b`` (tensors, None, or lists/tuples of them, nested) equal within RTOL/ATOL;
    a None must be None on both sides (a gradient that stayed None)."""
    if a is None or b is None:
        assert a is None and b is None, (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            close_nested(x, y)
    else:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def side_by_side_results(runs, world, case, labels=("torch", "hybrid")):
    """Per rank, the results of ``labels`` in a case run by ``_workers.side_by_side`` (a tuple,
    in the order of ``labels``); each must have run without error."""
    out = []
    for res in runs[world]:
        for label in labels:
            assert "error" not in res[case][label], f"{label}:\n{res[case][label].get('traceback')}"
        out.append(tuple(res[case][label]["result"] for label in labels))
    return out


class LazyWorlds(dict):
    """Every case of one world size run in one spawn when a test first asks for that world (so each
    spawn counts against one test's timeout, not all three against the first): ``self[world]`` is
    the list of the ranks' results, read from ``{prefix}_rank{r}.pt``."""

    def __init__(self, worker, cases, prefix: str):
        super().__init__()
        self.worker, self.cases, self.prefix = worker, list(cases), prefix

    def __missing__(self, world):
        outdir = _spawn(self.worker, world, self.cases)
        self[world] = [torch.load(os.path.join(outdir, f"{self.prefix}_rank{r}.pt")) for r in range(world)]
        return self[world]


@pytest.fixture(scope="module")
def parity():
    return LazyWorlds(_workers.parity_worker, _workers.CASES, "parity")


def _check_no_error(out):
    for label in ("torch", "hybrid"):
        assert "error" not in out[label], f"{label} failed:\n{out[label].get('traceback')}"


BROKEN_IN_TORCH = {"hook_batched_powerSGD_hook"}  # torch 2.13's own hook asserts (see test below)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(set(_workers.CASES) - BROKEN_IN_TORCH))
def test_parameters_match_torch_ddp(parity, world, case):
    for rank, res in enumerate(parity[world]):
        out = res[case]
        _check_no_error(out)
        ours, ref = out["hybrid"], out["torch"]
        for i, (a, b) in enumerate(zip(ours["params"], ref["params"])):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} param {i}: {m}")
        for a, b in zip(ours["buffers"], ref["buffers"]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        # Which gradients stayed None (unused on every rank) must match too.
        assert ours["grads_none"] == ref["grads_none"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_agree(parity, world):
    # Different data per rank, different initial parameters per rank: DDP must still agree.
    for case in set(_workers.CASES) - BROKEN_IN_TORCH:
        first = parity[world][0][case]["hybrid"]["params"]
        for res in parity[world][1:]:
            for a, b in zip(res[case]["hybrid"]["params"], first):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["membership", "membership_default_caps", "negative_cap"])
def test_bucket_membership_matches_torch_reducer_after_rebuild(parity, world, case):
    for res in parity[world]:
        out = res[case]
        _check_no_error(out)
        assert len(out["torch"]["membership"]) >= 1
        assert out["hybrid"]["membership"] == out["torch"]["membership"]
        assert out["hybrid"]["plan"] == out["torch"]["membership"]
    if case == "negative_cap":
        assert len(parity[world][0][case]["torch"]["membership"]) == 1  # unlimited: one bucket
    if case == "membership":
        assert len(parity[world][0][case]["torch"]["membership"]) > 3  # really many buckets


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_unused_parameters(parity, world):
    out = parity[world][0]["find_unused"]["hybrid"]
    names = [n for n, _ in _workers.Unused().named_parameters()]
    none = dict(zip(names, out["grads_none"]))
    # ``never`` is unused on every rank: its grad stays None; ``sometimes`` is used on rank 0 only:
    # it gets the reduced gradient (rank 0's alone at world size 1).
    assert none["never.weight"] and none["never.bias"]
    assert not none["sometimes.weight"] and not none["a.weight"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_outputs_left_out_of_the_loss(parity, world):
    # torch's _DDPSink: a head no rank's loss uses keeps .grad None (it used to hang the reduction
    # and raise at the next forward); one rank 0 uses gets the reduced gradient on every rank.
    for res in parity[world]:
        none = dict(zip([n for n, _ in _workers.Heads().named_parameters()],
                        res["find_unused_outputs"]["hybrid"]["grads_none"]))
        assert none["never.weight"] and none["never.bias"]
        assert not none["sometimes.weight"] and not none["a.weight"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_batched_powerSGD_fails_like_torch(parity, world):
    # Past start_powerSGD_iter, torch 2.13's batched_powerSGD_hook hands the 2-D Q matrix to
    # _orthogonalize, which asserts a 3-D batch: it fails under torch's DDP whatever the shapes or
    # rank. Ours runs the same hook unchanged, so it must fail the same way, on every rank.
    for res in parity[world]:
        out = res["hook_batched_powerSGD_hook"]
        assert out["torch"].get("error", (None,))[0] == "AssertionError", out["torch"]
        assert out["hybrid"].get("error", (None,))[0] == "AssertionError", out["hybrid"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_batched_powerSGD_warmup_matches_torch(parity, world):
    # The part of torch's batched hook that works (its warm-up all-reduce): same parameters, and
    # the hook's own iteration counter (advanced on GradBucket.is_last()) moved the same way.
    for res in parity[world]:
        out = res["hook_batched_powerSGD_hook_warmup"]
        _check_no_error(out)
        assert out["hybrid"]["hook_iter"] == out["torch"]["hook_iter"] == _workers.STEPS


@pytest.fixture(scope="module")
def errors():
    outdir = _spawn(_workers_errors.errors_worker, 2)
    return [torch.load(os.path.join(outdir, f"errors_rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("key, exc, pattern", [
    ("count", "RuntimeError", "DDP expects same model across all ranks"),
    ("shape", "RuntimeError", "params\\[0\\] \\('layers.0.weight'\\)"),
    ("unused", "RuntimeError", "Expected to have finished reduction in the prior iteration"),
    ("static_changed", "RuntimeError", "Your training graph has changed in this iteration"),
    ("not_callable", "TypeError", "Communication hook must be callable"),
    ("twice", "RuntimeError", "can only be called once"),
    ("no_future", "RuntimeError", "must return a torch.futures.Future"),
    ("bad_future_int_torch", "RuntimeError", "Unable to cast 3 to Tensor"),
    ("bad_future_int_hybrid", "RuntimeError", "Unable to cast 3 to Tensor.*bucket 0"),
    ("bad_future_dict_torch", "RuntimeError", "Unable to cast {'a': 1} to Tensor"),
    ("bad_future_dict_hybrid", "RuntimeError", "Unable to cast {'a': 1} to Tensor.*bucket 0"),
    ("cap_differs", "ValueError", "bucket_cap_mb \\(MB\\): rank 0 has 1, rank 1 has 25"),
    ("unsupported", "TypeError", "mixed_precision must be a torch.nn.parallel.distributed._MixedPrecision"),
])
def test_errors(errors, key, exc, pattern):
    import re
    for rank, res in enumerate(errors):
        assert res[key] is not None, f"rank {rank}: no error for {key}"
        assert res[key][0] == exc, res[key]
        assert re.search(pattern, res[key][1]), res[key][1]


def test_static_graph_param_used_then_unused_raises_like_torch(errors):
    # ``sometimes`` gets a gradient in iteration 1 only. torch raises at the forward after the first
    # backward that leaves it out (the third forward), naming the graph change and the indices.
    for rank, res in enumerate(errors):
        (ref, ref_done), (ours, ours_done) = (res["static_used_then_unused_torch"],
                                              res["static_used_then_unused_hybrid"])
        assert ref is not None and ref[0] == "RuntimeError", ref
        assert ours is not None and ours[0] == ref[0] and ours_done == ref_done == 2, (ours, ours_done)
        assert "training graph has changed in this iteration" in ref[1]
        # torch's first two lines (the reason, the indices 4 5 of sometimes.weight/bias), verbatim.
        assert ours[1].splitlines()[:2] == ref[1].splitlines()[:2], (ours[1], ref[1])
        assert ref[1].splitlines()[1].endswith(": 4 5")


def test_count_error_names_both_ranks(errors):
    # rank 0 has 6 parameters, rank 1 has 8: both ranks say so (it said "rank 1 ... rank 1").
    for res in errors:
        assert "rank 0 has 6 params, while rank 1 has inconsistent 8 params" in res["count"][1], res["count"]


def test_unused_error_names_the_parameters(errors):
    msg = errors[0]["unused"][1]
    assert "never.weight" in msg and "sometimes.weight" in msg and "a.weight" not in msg


def test_marked_ready_twice_text_is_torchs(errors):
    # A reentrant checkpoint with find_unused_parameters: torch's text, naming the parameter.
    for res in errors:
        ref, ours = res["marked_twice_torch"], res["marked_twice_hybrid"]
        assert ref is not None and "Expected to mark a variable ready only once" in ref[1], ref
        assert "with name a.bias has been marked as ready twice" in ref[1], ref
        assert ours == ref, f"{ours}\n--- torch:\n{ref}"


@pytest.mark.parametrize("misuse", ["plain", "find_unused", "static"])
def test_unfinished_reduction_text_is_torchs(errors, misuse):
    # torch's reducer text, all three wordings. With TORCH_DISTRIBUTED_DEBUG=INFO (DETAIL prints
    # the same; it also wraps gloo in a checking group that crashes torch 2.13 in a 1-rank world),
    # word for word: the reason, then the names (last registered first), then the indices. With debugging off,
    # torch ends with advice to set INFO to see the names; ours gives the names on that line.
    for rank, res in enumerate(errors):
        texts = res["unfinished_texts"]
        ref, ours = texts["INFO", misuse, "torch"], texts["INFO", misuse, "hybrid"]
        assert ref is not None and ref[0] == "RuntimeError", ref
        assert ours == ref, f"rank {rank}:\n{ours[1]}\n--- torch:\n{ref[1]}"
        assert f"Parameters which did not receive grad for rank {rank}: " in ref[1]
        ref, ours = texts["OFF", misuse, "torch"], texts["OFF", misuse, "hybrid"]
        assert ours[1].splitlines()[:-1] == ref[1].splitlines()[:-1], f"{ours[1]}\n--- torch:\n{ref[1]}"
        assert "TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL" in ref[1].splitlines()[-1]
        names = next(line for line in texts["INFO", misuse, "torch"][1].splitlines()
                     if line.startswith("Parameters which"))
        assert ours[1].splitlines()[-1] == names


def test_state_dict_keys_like_torch(errors):
    assert errors[0]["state_dict_keys"] == errors[0]["torch_state_dict_keys"]
    assert all(k.startswith("module.") for k in errors[0]["state_dict_keys"])


@pytest.mark.parametrize("world", (2, 3))
def test_join_throw_on_early_termination_like_torch(parity, world):
    # Rank r has STEPS + r batches. With throw_on_early_termination=True, torch's Join raises on
    # every rank once rank 0 runs out: "Rank 0 exhausted all inputs." on rank 0, "Detected at least
    # one rank that exhausted inputs..." on the others, after the same number of completed steps.
    for rank in range(world):
        ref, ours = parity[world][rank]["join_throw"]["torch"], parity[world][rank]["join_throw"]["hybrid"]
        assert ref["error"] is not None and ref["error"][0] == "RuntimeError", ref["error"]
        assert ours["error"] == ref["error"]
        assert ours["steps"] == ref["steps"] == _workers.STEPS
        expected = "Rank 0 exhausted all inputs." if rank == 0 else "exhausted inputs. Throwing across all ranks"
        assert expected in ours["error"][1]
        for a, b in zip(ours["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_dead_peer_raises_quickly():
    outdir = tempfile.mkdtemp(prefix="hybrid_ddp_dead_")
    _spawn_into(outdir, _workers_errors.dead_peer_worker, 2)
    res = torch.load(os.path.join(outdir, "dead_rank0.pt"))
    assert res["error"] is not None
    assert res["elapsed"] < 5.0, res


@pytest.mark.parametrize("sizes, order, expect_launch", [
    ((256, 256, 256), (1, 2, 0), [(), (0, 1), (2,)]),
    ((256, 256, 256), (2, 1, 0), [(0,), (1,), (2,)]),
    ((256, 256, 256), (0, 1, 2), [(), (), (0, 1, 2)]),
])
def test_reducer_state_launches_in_bucket_order(sizes, order, expect_launch):
    plan = plan_buckets([TensorSpec(f"p{i}", (n,), "float32") for i, n in enumerate(sizes)],
                        bucket_cap_bytes=1024, first_bucket_cap_bytes=1024)
    state = start_iteration(plan)
    got = []
    for t in order:
        state, launch = mark_ready(state, t)
        got.append(launch)
    assert got == expect_launch and state.finished and state.ready_order == order


def test_reducer_state_rejects_double_mark_and_tracks_unused():
    plan = plan_buckets([TensorSpec(f"p{i}", (4,), "float32") for i in range(3)])
    state, launch = mark_unused(start_iteration(plan), [1])
    assert launch == () and state.unused == {1} and state.missing() == (0, 2)
    with pytest.raises(RuntimeError, match="only once"):
        mark_ready(state, 1)
    with pytest.raises(ValueError, match="outside"):
        mark_ready(state, 7)


def test_stalled_peer_respects_process_group_timeout():
    outdir = tempfile.mkdtemp(prefix="hybrid_ddp_stall_")
    _spawn_into(outdir, _workers_errors.stalled_peer_worker, 2)
    res = torch.load(os.path.join(outdir, "stalled_rank0.pt"))
    assert res["error"] is not None, res
    assert 1.5 < res["elapsed"] < 5.0, res  # the 2 s timeout, not the peer's 6 s sleep


@pytest.mark.parametrize("n, cap_bytes, seed", [(5, 1024, 0), (300, 4096, 1), (2000, 16384, 2), (64, 1 << 20, 3)])
def test_reducer_state_matches_set_reference(n, cap_bytes, seed):
    # The bitmask / cons-list state against a plain reference kept with a set and a list: the
    # launches after every event (the longest prefix of buckets whose members are all ready),
    # the ready order, what is missing halfway, and a second mark of an already-ready tensor.
    import random
    rng = random.Random(seed)
    plan = plan_buckets([TensorSpec(f"p{i}", (rng.randint(1, 64),), "float32") for i in range(n)],
                        bucket_cap_bytes=cap_bytes, first_bucket_cap_bytes=cap_bytes)
    order = list(range(n))
    rng.shuffle(order)
    state, seen, launched = start_iteration(plan), set(), 0
    for k, t in enumerate(order):
        state, launch = mark_ready(state, t)
        seen.add(t)
        end = launched
        while end < plan.num_buckets and set(plan.buckets[end].members) <= seen:
            end += 1
        assert launch == tuple(range(launched, end)), (k, t)
        launched = end
        if k == n // 2:
            assert state.missing() == tuple(sorted(set(range(n)) - seen))
            assert state.is_ready(t) and state.started and state.num_ready == k + 1
            with pytest.raises(RuntimeError, match="only once"):
                mark_ready(state, order[0])
    assert state.finished and state.ready_order == tuple(order) and state.missing() == ()
