"""hybrid.torch.DistributedDataParallel with ``mixed_precision=_MixedPrecision(...)`` against torch's
class in the same gloo processes, world sizes 1, 2, 3 (torch's CUDA events stubbed out on CPU: see
_workers_mixed_precision.py).

Tolerance: none. Both run the same ops in the same order on the same tensors (low-precision
copies made by ``copy_``, gradients cast into a bucket of the reduce dtype, one gloo all-reduce of
a bucket of the same length, a division by the world size in that dtype, a cast into the float32
``.grad``, the same optimizer on the float32 parameters), so results are compared bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _workers_mixed_precision as W  # noqa: E402
from test_ddp import WORLD_SIZES, LazyWorlds  # noqa: E402

TRAIN = sorted(c for c in W.CASES if c.startswith("train_"))
# torch 2.13's gradient_as_bucket_view with mixed precision returns wrong gradients after a
# zero_grad(set_to_none=True) (its upcast gives .grad its own storage, which then misses the reduced
# bucket): ours, where .grad cannot view a bucket of another dtype anyway, is compared with torch
# without gradient_as_bucket_view, the same result up to memory use.
VIEW_REFERENCE = {"train_bf16_view": "train_bf16_sgd", "train_f16_f32_view": "train_f16_f32_adam"}


@pytest.fixture(scope="module")
def runs():
    return LazyWorlds(W.mixed_precision_worker, W.CASES, "mixed_precision")


def _exact(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _ok(res, case):
    """(torch's result, ours); torch's from the reference case where torch's own is wrong."""
    for label in ("torch", "hybrid"):
        assert "error" not in res[case][label], f"{label}:\n{res[case][label].get('traceback')}"
    return res[VIEW_REFERENCE.get(case, case)]["torch"]["result"], res[case]["hybrid"]["result"]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", TRAIN)
def test_training_matches_torch(runs, world, case):
    # After torch's buckets are rebuilt: every step's output dtype, parameter dtypes in forward
    # (param_dtype) and after backward (float32), .grad (float32, the reduced value), the float32
    # parameters after the optimizer step and the buffers (buffer_dtype).
    param_dtype = W.CASES[case][1][0][0]
    for rank, res in enumerate(runs[world]):
        ref, ours = _ok(res, case)
        assert ours["setup"] == ref["setup"]
        for step, (a, b) in enumerate(zip(ours["steps"], ref["steps"])):
            where = f"rank {rank} step {step}"
            assert a["out_dtype"] == b["out_dtype"] == param_dtype, where
            n = len(a["params"])
            assert a["dtypes_in_forward"] == b["dtypes_in_forward"] == [param_dtype] * n, where
            assert a["dtypes_after_backward"] == b["dtypes_after_backward"] == [torch.float32] * n, where
            for i, (g, h) in enumerate(zip(a["grads"], b["grads"])):
                _exact(g, h, f"{where} grad {i}")
                assert g is None or g.dtype == torch.float32
            for i, (p, q) in enumerate(zip(a["params"] + a["buffers"], b["params"] + b["buffers"])):
                _exact(p, q, f"{where} param/buffer {i}")
        _exact(ours["eval"], ref["eval"], f"rank {rank} eval forward")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(VIEW_REFERENCE))
def test_torch_gradient_as_bucket_view_is_still_wrong(runs, world, case):
    # The torch bug behind VIEW_REFERENCE: its first step after zero_grad(set_to_none=True).
    for res in runs[world]:
        own, right = res[case]["torch"]["result"], res[VIEW_REFERENCE[case]]["torch"]["result"]
        assert not all(torch.equal(g, h) for g, h in zip(own["steps"][0]["grads"], right["steps"][0]["grads"])
                       if g is not None)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", TRAIN)
def test_gradients_right_from_the_first_pass(runs, world, case):
    # torch 2.13 reduces garbage until its buckets are rebuilt (its first pass, both first passes
    # with static_graph): it casts the buckets to param_dtype after building their views, so the
    # gradients land in the old buckets. Ours gives, from the first pass, what torch gives on the
    # same parameters and batch once rebuilt (BatchNorm in training uses batch statistics).
    # Bit for bit, except our first pass at world size 3 reducing in 16 bits: its buckets are the
    # initial ones, torch's rebuilt ones order the parameters differently, and gloo's ring adds
    # three contributions in an order that depends on an element's position in the bucket (the
    # sums differ in the last place of the reduce dtype; from our second pass, same buckets, none).
    mp = W.CASES[case][1][0]
    eps = torch.finfo(mp[1] or mp[0]).eps
    for rank, res in enumerate(runs[world]):
        ref, ours = _ok(res, case)
        torch_right = ref["warmup"][-1]
        for n, grads in enumerate(ours["warmup"]):
            for i, (g, h) in enumerate(zip(grads, torch_right)):
                if n == 0 and world == 3 and eps > 1e-4 and h is not None:
                    torch.testing.assert_close(g, h, rtol=2 * eps, atol=2 * eps * float(h.abs().max()))
                else:
                    _exact(g, h, f"rank {rank} pass {n} grad {i}")
        assert not all(torch.equal(g, h) for g, h in zip(ref["warmup"][0], torch_right) if g is not None)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", TRAIN)
def test_first_pass_matches_single_process_reference(runs, world, case):
    # Independently of torch: the mean over ranks of each rank's low-precision gradient (float64),
    # within the rounding of a sum in the reduce dtype and its cast (a few units in the last place).
    mp = W.CASES[case][1][0]
    reduce_dtype = mp[1] or mp[0]
    rtol = 4 * world * torch.finfo(reduce_dtype).eps
    for res in runs[world]:
        _, ours = _ok(res, case)
        for g, r in zip(ours["warmup"][0], res[case]["reference"]):
            if r is None:
                assert g is None
                continue
            torch.testing.assert_close(g.double(), r, rtol=rtol, atol=rtol * float(r.abs().max()))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", TRAIN)
def test_forward_under_no_grad(runs, world, case):
    # torch 2.13 raises on a forward under no_grad (AttributeError in its copy hook); ours runs it
    # in param_dtype, equal to the eval forward with grad enabled, then restores float32.
    for res in runs[world]:
        ref, ours = _ok(res, case)
        _exact(ours["no_grad"], ours["eval"], "no_grad forward")
        for (dtype, p), q in zip(ours["after_no_grad"], ours["steps"][-1]["params"]):
            assert dtype == torch.float32
            _exact(p, q, "parameter after the no_grad forward")


# Where torch 2.13 fails, ours raises too, with a message naming the combination.
OUTCOMES = {
    "with_comm_hook": (("RuntimeError", "can only be called once"), ("RuntimeError", "can only be called once")),
    "with_builtin_hook": (("RuntimeError", "can only be called once"), ("RuntimeError", "can only be called once")),
    "with_no_sync": (("RuntimeError", "mark a variable ready only once"), ("RuntimeError", "no_sync()")),
    "with_pickle": (("TypeError", "cannot pickle"), ("TypeError", "cannot pickle")),
    "with_deepcopy": (("TypeError", "cannot pickle"), ("TypeError", "cannot pickle")),
    "with_step": (("AttributeError", "'NoneType'"), ("NotImplementedError", "find_unused_parameters=True")),
    "with_no_param_dtype": (("RuntimeError", "Expected Byte"), ("ValueError", "param_dtype is None")),
    "with_no_grad": (("AttributeError", "'NoneType'"), None),
}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(OUTCOMES))
def test_combinations_fail_where_torch_fails(runs, world, case):
    torch_outcome, ours_outcome = OUTCOMES[case]
    for res in runs[world]:
        for label, expected in (("torch", torch_outcome), ("hybrid", ours_outcome)):
            got = res[case][label]
            if expected is None:
                assert got.get("result") == "ok", got.get("traceback")
            else:
                assert "error" in got, f"{label} did not raise"
                assert got["error"][0] == expected[0] and expected[1] in got["error"][1], (label, got["error"])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ignored_parameters_and_buffers_are_not_cast(runs, world):
    for res in runs[world]:
        ref, ours = _ok(res, "ignored")
        assert ours == ref
        assert ours["fc1.weight"] == (False, False, torch.float32) and ours["seen"][2] == torch.float32
        assert ours["fc1.bias"] == (True, True, torch.float32)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_must_agree_on_mixed_precision(runs, world):
    for res in runs[world]:
        ours = res["disagree"]["hybrid"]
        if world == 1:
            assert ours.get("result") == "ok", ours.get("traceback")
        else:
            assert ours["error"][0] == "ValueError" and "ranks disagree on mixed_precision" in ours["error"][1]
