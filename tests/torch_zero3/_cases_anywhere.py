"""Cases for parameters used anywhere (issue 36, item 4) and for calling the inner module (item 7),
run in the worlds of ``test_zero3_dist`` (``_cases`` merges them): ZeRO3 + ZeRO3Optimizer against
torch's DDP + Adam on models that read parameters outside their own module's forward, bit for bit
at 1 and 2 ranks (``_pair``'s tolerance at 3), every gradient bucket reduced exactly once per
backward; and the inner module called outside ``model(x)``, with and without ``gathered()``,
giving DDP's outputs (it crashed or raised before)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.torch_zero._cases import batch
from tests.torch_zero3._models import RootScale, Siblings, TinyGPT, tokens
from tests.torch_zero3._pair import ATOL, LAYOUTS, RTOL, Pair

MODELS = {"root_scale": (RootScale, batch), "tiny_gpt": (TinyGPT, tokens), "siblings": (Siblings, batch)}


def _count_reductions(pair: Pair) -> list[int]:
    """The buckets the gradient reducer launches, in order (one reduction each)."""
    launched: list[int] = []
    launch = pair.zero._grads._launch
    pair.zero._grads._launch = lambda b: (launched.append(b), launch(b))[1]
    return launched


def _same(ours: torch.Tensor, ref: torch.Tensor, world_size: int, what: str) -> None:
    if world_size <= 2:
        assert torch.equal(ours, ref), f"{what}: differs by {(ours - ref).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL, msg=what)


def _declared(model: Siblings) -> dict:
    """What DeepSpeed has users declare by hand (``register_external_parameter``): ``reader``'s
    forward reads ``mix.weight``; the parent's forward reads ``out``'s parameters."""
    return {"external_params": {model.reader: [model.mix.weight], model: [model.out.weight, model.out.bias]}}


def used_anywhere(rank: int, world_size: int, *, model: str, layout: str, declare: bool = False,
                  step_in_backward: bool = False) -> None:
    make, data = MODELS[model]
    pair = Pair("adam", LAYOUTS[layout], model=make(), zero3_options=_declared if declare else None,
                optimizer_options={"step_in_backward": step_in_backward})
    launched = _count_reductions(pair)
    for step in range(3):
        del launched[:]
        pair.backward(data(rank, step))
        assert launched == list(range(pair.zero.bucket_plan.num_buckets)), f"step {step}: reduced {launched}"
        if declare:  # declared: gathered by the modules that read them, none kept for the backward
            assert not pair.zero._schedule._kept, pair.zero._schedule._kept
        pair.step()
        pair.check(world_size, f"step {step}")
    assert pair.zero._working.live == 0, "a bucket outlived its backward"


def inner_module_calls(rank: int, world_size: int, *, model: str) -> None:
    """After a step: ``model.module(x)`` under no_grad (a SIGSEGV before), inside ``gathered()`` (a
    "setStorage ... out of bounds" error before), a block of it called alone, and with autograd,
    a backward and a step through ``model.module(x)``: all as DDP's."""
    make, data = MODELS[model]
    pair = Pair("adam", LAYOUTS["four_buckets"], model=make())
    pair.backward(data(rank, 0))
    pair.step()
    x = data(rank, 1)
    with torch.no_grad():
        ref = pair.ref_model(x)
        _same(pair.zero.module(x), ref, world_size, "model.module(x) under no_grad")
    assert all(s == "free" for s in pair.zero._buckets.state), pair.zero._buckets.state
    with pair.zero.gathered():
        _same(pair.zero.module(x).detach(), ref, world_size, "model.module(x) inside gathered()")
        _same(pair.zero(x).detach(), ref, world_size, "model(x) inside gathered()")
    if model == "tiny_gpt":
        h = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            _same(pair.zero.module.blocks[1](h), pair.ref_model.blocks[1](h), world_size, "a block called alone")
    pair.zero.module(x).pow(2).mean().backward()  # the inner module with autograd: model(x)'s gathers
    pair.ref_ddp(x).pow(2).mean().backward()
    pair.step()
    pair.check(world_size, "after a step through model.module(x)")
    with pytest.raises(RuntimeError, match=r"is not available: it is sharded"):
        next(pair.zero.module.parameters()).sum()  # outside any forward: the documented error


CASES = {f"used_anywhere[{m}-{layout}]": functools.partial(used_anywhere, model=m, layout=layout)
         for m in MODELS for layout in ("default", "four_buckets", "four_buckets_kept", "memory_policy")}
CASES["used_anywhere[siblings-four_buckets-declared]"] = functools.partial(
    used_anywhere, model="siblings", layout="four_buckets", declare=True)
CASES.update({f"used_anywhere[{m}-four_buckets-step_in_backward]": functools.partial(
    used_anywhere, model=m, layout="four_buckets", step_in_backward=True) for m in MODELS})
CASES.update({f"inner_module_calls[{m}]": functools.partial(inner_module_calls, model=m) for m in MODELS})
