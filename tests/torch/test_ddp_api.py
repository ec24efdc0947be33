"""torch DDP's remaining APIs on hybrid.torch.DistributedDataParallel (issue 15):
``_register_fused_optim``, ``_register_buffer_comm_hook``, ``delay_all_reduce_named_params`` /
``param_to_hook_all_reduce`` and a 1-D ``device_mesh``. Each case runs under torch's class and
ours in the same gloo processes, world sizes 1, 2, 3."""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import DistributedDataParallel as HybridDDP

sys.path.insert(0, os.path.dirname(__file__))
import _workers_api  # noqa: E402
from test_ddp import WORLD_SIZES, LazyWorlds, close_nested as _close, side_by_side_results as _results  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return LazyWorlds(_workers_api.api_worker, _workers_api.CASES, "api")


def _errors(runs, world, case):
    """Per rank, (torch's error, ours): both must have raised."""
    out = []
    for res in runs[world]:
        ref, ours = res[case]["torch"], res[case]["hybrid"]
        assert "error" in ref and "error" in ours, (ref, ours)
        out.append((ref["error"], ours["error"]))
    return out


def _same_on_every_rank(results, key):
    for res in results[1:]:
        _close(res[key], results[0][key])


# ---- _register_fused_optim ------------------------------------------------------------------

FUSED = sorted(c for c in _workers_api.CASES if c.startswith("fused_") and c[6:].split("_")[0] in ("SGD", "Adam"))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", FUSED)
def test_fused_optimizer_steps_like_torch(runs, world, case):
    # Parameters stepped inside the backward equal torch's class with _register_fused_optim and
    # a plain step after backward; .grad after each backward is the averaged gradient (kept, as
    # torch keeps it) on both.
    results = _results(runs, world, case)
    for ref, ours in results:
        _close(ours["params"], ref["params"])
        _close(ours["grads"], ref["grads"])
        _close(ours["params"], ours["plain"])
        _close(ref["params"], ref["plain"])
        assert all(g is not None for g in ours["grads"][-1])
        moved = [not torch.equal(a, b) for a, b in zip(ours["params"], ours["initial"])]
        if case.endswith("_subset"):  # only the first parameter is optimized
            assert moved[0] and not any(moved[1:]), moved
        else:
            assert all(moved), moved
    _same_on_every_rank([ours for _, ours in results], "params")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fused_callback_sees_what_torch_shows(runs, world):
    # In the Future's then-callback of _hook_then_optimizer, bucket.gradients() / parameters()
    # hold, for every parameter, the averaged gradient torch's bucket holds there; the same
    # values then land in .grad.
    for ref, ours in _results(runs, world, "fused_callback_view"):
        assert all(g is not None for step in ours["seen"] for g in step)
        _close(ours["seen"], ref["seen"])
        _close(ours["seen"][-1], ours["grads"])


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["fused_hook_first", "fused_hook_after", "fused_unknown_optim"])
def test_fused_optimizer_refusals_like_torch(runs, world, case):
    # A fused optimizer is the DDP's comm hook: with another hook, before or after, both raise.
    for ref, ours in _errors(runs, world, case):
        assert ref == ours, (ref, ours)


# ---- _register_buffer_comm_hook -------------------------------------------------------------

BUFFER = sorted(c for c in _workers_api.CASES if c.startswith("buffer_") and c != "buffer_not_callable")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", BUFFER)
def test_buffer_hook_like_torch(runs, world, case):
    results = _results(runs, world, case)
    for ref, ours in results:
        _close(ours["buffers"], ref["buffers"])
        _close(ours["after_forward"], ref["after_forward"])
        _close(ours["after_step"], ref["after_step"])
        _close(ours["params"], ref["params"])
    if world > 1 and "average" in case:
        # The hook replaced the broadcast from rank 0: averaged buffers differ from broadcast ones.
        plain = _results(runs, world, "buffer_none")[0][1]
        assert not torch.equal(results[0][1]["buffers"][0], plain["buffers"][0])
    if world > 1 and case.endswith("POST_FORWARD"):
        # Reduced after the last forward: equal on every rank (a PRE_FORWARD hook's forward, or
        # the eval forward before it, leaves the last update local).
        _same_on_every_rank([ours for _, ours in results], "buffers")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_buffer_hook_must_be_callable_like_torch(runs, world):
    for ref, ours in _errors(runs, world, "buffer_not_callable"):
        assert ref == ours == ("AssertionError", "hook must be callable, got str")


# ---- delay_all_reduce_named_params ----------------------------------------------------------

DELAY = {"delay_last": "delay_none", "delay_last_zero_in_place": "delay_none",
         "delay_last_no_sync": "delay_none_no_sync", "delay_middle_static": "delay_none_static"}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(DELAY))
def test_delayed_all_reduce_like_torch(runs, world, case):
    # Gradients and parameters equal torch's plain DDP on the same model (delaying changes when
    # the average is taken, not its value) and torch's class with the same delayed parameters.
    # Except under no_sync(): torch 2.13 never waits for its delayed all-reduce, so a second
    # micro-batch accumulates into the buffer while the first one's reduction may still write to
    # it, and its gradients change from run to run; ours waits at the end of each backward.
    ours_only = case.endswith("no_sync")
    results = _results(runs, world, case, labels=("hybrid",) if ours_only else ("torch", "hybrid"))
    plain = _results(runs, world, DELAY[case], labels=("torch",))
    for res, (ref,) in zip(results, plain):
        ours = res[-1]
        _close(ours["params"], ref["params"])
        _close(ours["grads"], ref["grads"])
        if not ours_only:
            _close(ours["params"], res[0]["params"])
            _close(ours["grads"], res[0]["grads"])
            assert ours["ignored"] == res[0]["ignored"]
        # The bucket plan holds every trainable parameter but the delayed ones.
        names = [f"layers.{k}.{w}" for k in range(3) for w in ("weight", "bias")]
        assert ours["planned"] == sorted(set(names) - set(ours["ignored"]))
        assert ours["ignored"]
    _same_on_every_rank([res[-1] for res in results], "params")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_parameter_delayed(runs, world):
    # Every trainable parameter delayed: torch 2.13's class builds no reducer and its forward
    # then fails (no _lazy_init_ran); ours runs the module alone and all-reduces the delayed
    # buffer, which equals torch's plain DDP over the same model.
    for res in runs[world]:
        assert res["delay_all"]["torch"]["error"][0] == "AttributeError"
    results = _results(runs, world, "delay_all", labels=("hybrid",))
    refs = _results(runs, world, "frozen_reference", labels=("torch",))
    for (ours,), (ref,) in zip(results, refs):
        _close(ours["params"], ref["params"])
        _close(ours["buffers"], ref["buffers"])


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case, error", [
    ("delay_half_given", ("ValueError", "delay_all_reduce_named_params and param_to_hook_all_reduce "
                                        "need to be set at the same time.")),
    ("delay_everything", ("ValueError", "DistributedDataParallel's input module must be on the same "
                                        "type of devices, but input module parameters locate in set().")),
])
def test_delayed_all_reduce_refusals_like_torch(runs, world, case, error):
    for ref, ours in _errors(runs, world, case):
        assert ref == ours == error


# ---- device_mesh ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", ["mesh", "mesh_sliced"])
def test_device_mesh_like_torch(runs, world, case):
    # A 1-D mesh (sliced from a 2-D one too): DDP reduces over its group, as torch's class.
    results = _results(runs, world, case)
    for ref, ours in results:
        _close(ours["params"], ref["params"])
    _same_on_every_rank([ours for _, ours in results], "params")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case, start", [
    ("mesh_2d", "Only 1D device mesh is supported, but got DeviceMesh("),
    ("mesh_and_group", "Cannot specify both process_group and device_mesh arguments."),
])
def test_device_mesh_refusals_like_torch(runs, world, case, start):
    for ref, ours in _errors(runs, world, case):
        assert ref == ours and ours[0] == "RuntimeError" and ours[1].startswith(start), (ref, ours)


@pytest.mark.parametrize("name", ["_register_fused_optim", "_register_buffer_comm_hook"])
def test_method_signatures_like_torch(name):
    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert shape(getattr(HybridDDP, name)) == shape(getattr(TorchDDP, name))
