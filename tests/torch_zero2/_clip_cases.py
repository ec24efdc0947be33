"""ZeRO2's clipping against torch's ``clip_grad_norm_`` / ``clip_grad_value_`` on DDP's unsharded
gradients, and torch's own clip functions refusing the sharded ones.

SGD with momentum (a step proportional to the clipped gradient; Adam would hide the scale).
Tolerances: parameters as in ``_pair`` (rtol 1.3e-6, atol 1e-6); the total norm rtol 1.3e-6: both
sides sum the same float32 squares (of the same averaged gradients), in a different order.

On the Llama decoder (issue 44, item 5; :func:`assert_clips_as_torch`, shared with ZeRO3) the
oracles are the float64 norm of the very gradients the optimizer holds (gathered from every rank)
and torch's ``clip_grad_norm_`` on a float32 copy of them: the returned norm must be within the
larger of 1e-6 relative and torch's own error against the float64 norm (the slices used to be
normed in float32 over a whole bucket at once, 6e-5 off); the clipped gradients are the gradients
times torch's factor ``clamp(max_norm / (norm + 1e-6), max=1)`` bit for bit, and within the two
norms' relative difference plus two float32 roundings of torch's clipping.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

from hybrid.models import Llama, LlamaConfig
from hybrid.torch import DistributedDataParallel, ZeRO2
from tests.torch_zero._cases import batch
from tests.torch_zero2._pair import DDP_OPTIONS, RTOL, Pair

MAX_NORM = 0.02  # below every step's gradient norm (asserted), so every step clips


def clip_norm(rank: int, world_size: int, *, norm_type: float, ddp: str, flat: bool = False) -> None:
    """The same total norm on every rank as torch's on the full gradient, the same parameters after."""
    pair = Pair("sgd_momentum", DDP_OPTIONS[ddp], flat=flat)
    for step in range(3):
        pair.backward(batch(rank, step))
        want = torch.nn.utils.clip_grad_norm_(pair.ref_model.parameters(), MAX_NORM, norm_type)
        got = pair.opt.clip_grad_norm_(MAX_NORM, norm_type)
        assert want > 2 * MAX_NORM, f"step {step}: norm {want} would not clip"
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=f"step {step}: total norm")
        pair.step()
        pair.check(f"step {step}")


def clip_value(rank: int, world_size: int) -> None:
    pair = Pair("sgd_momentum", DDP_OPTIONS["two_buckets"])
    for step in range(3):
        pair.backward(batch(rank, step))
        torch.nn.utils.clip_grad_value_(pair.ref_model.parameters(), 0.01)
        pair.opt.clip_grad_value_(0.01)
        pair.step()
        pair.check(f"step {step}")


def measure_only(rank: int, world_size: int) -> None:
    """max_norm=inf returns the norm and leaves the gradients alone (for logging)."""
    pair = Pair("sgd_momentum", {})
    pair.backward(batch(rank, 0))
    want = torch.nn.utils.clip_grad_norm_(pair.ref_model.parameters(), math.inf)
    torch.testing.assert_close(pair.opt.clip_grad_norm_(math.inf), want, rtol=RTOL, atol=0)
    pair.step()
    pair.check("after measuring")


def torch_clip_refused(rank: int, world_size: int) -> None:
    """torch's clip functions and gradient reads fail naming the parameter and ZeRO2's method
    (they used to see .grad None: clip_grad_norm_ returned tensor(0.) and clipped nothing)."""
    pair = Pair("sgd_momentum", {})
    pair.backward(batch(rank, 0))
    for use in (lambda: torch.nn.utils.clip_grad_norm_(pair.model.parameters(), 1.0),
                lambda: torch.nn.utils.clip_grad_value_(pair.model.parameters(), 1.0),
                lambda: [p.grad.norm() for p in pair.model.parameters()]):
        with pytest.raises(TypeError, match=r"parameter '[\w.]+'.*opt\.clip_grad_norm_\(max_norm"):
            use()
    pair.opt.step()  # the stand-ins change nothing for the step, and the next forward drops them
    pair.opt.zero_grad()
    pair.ref_opt.step()
    pair.ref_opt.zero_grad()
    pair.check("step 0")
    pair.backward(batch(rank, 1))
    pair.step()
    pair.check("step 1")


def llama_tokens(rank: int, step: int, config: LlamaConfig = LlamaConfig()) -> torch.Tensor:
    """This rank's batch of a step: 4 sequences of 33 tokens (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, config.vocab_size, (4, 33), generator=g)


def llama_backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()


def assert_clips_as_torch(opt, gather, norm_type: float, what: str) -> dict[str, float]:
    """``opt.clip_grad_norm_`` against the float64 norm and torch's ``clip_grad_norm_`` of the same
    gradients; ``gather()`` gives them whole (a collective): ``{index: flat gradient}``. Returns the
    three norms and the two relative errors, for the report."""
    grads = [g.clone() for _, g in sorted(gather().items())]
    exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in grads]),
                                     norm_type).item()
    copies = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    max_norm = exact / 2  # every norm type clips
    want = torch.nn.utils.clip_grad_norm_(copies, max_norm, norm_type)
    got = opt.clip_grad_norm_(max_norm, norm_type)
    assert got.dtype == want.dtype, f"{what}: norm dtype {got.dtype} != torch's {want.dtype}"
    err, torch_err = abs(got.item() - exact) / exact, abs(want.item() - exact) / exact
    assert err <= max(1e-6, torch_err), (f"{what}: norm {got.item():.9g}, float64 {exact:.9g} (relative {err:.2e}), "
                                         f"torch {want.item():.9g} ({torch_err:.2e})")
    # torch's scale factor, from our norm: the clipped gradients must be these, bit for bit; and
    # torch's own clipping within the two norms' difference plus two float32 roundings.
    coef = torch.clamp(max_norm / (got + 1e-6), max=1.0)
    rtol = abs(got.item() - want.item()) / want.item() + 2 * torch.finfo(torch.float32).eps
    for i, (c, g, (_, clipped)) in enumerate(zip(copies, grads, sorted(gather().items()))):
        assert torch.equal(clipped, g * coef), f"{what}: clipped gradient {i} is not gradient * torch's factor"
        torch.testing.assert_close(clipped, c.grad, rtol=rtol, atol=0,
                                   msg=lambda m, i=i: f"{what}: clipped gradient {i} against torch's: {m}")
    return {"ours": got.item(), "torch": want.item(), "float64": exact, "err": err, "torch_err": torch_err}


def clip_norm_llama(rank: int, world_size: int, *, bucket_cap_mb: float | None, dtype: torch.dtype) -> None:
    """ZeRO2 over hybrid's DDP of the Llama decoder (parameters in ``dtype``: bfloat16 ones step
    float32 masters), one backward per norm type."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    for p in model.parameters():  # not .to(dtype): that would make the complex freqs_cis real
        p.data = p.data.to(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opt = ZeRO2(ddp, torch.optim.SGD, lr=1.0)
    clip_llama_steps(ddp, opt, lambda: opt._gather_per_tensor(opt._grad_plan, opt._grad_shards, opt._grads),
                     rank, f"ZeRO2 rank {rank}/{world_size} {dtype} cap {bucket_cap_mb}")


def clip_llama_steps(model, opt, gather, rank: int, what: str) -> None:
    """A backward, a clip against torch's (one norm type each: 2, inf, 1) and an SGD step; the
    norms printed with HYBRID_PRINT_NORMS=1 (the figures of issue 44's note)."""
    for step, p in enumerate((2.0, math.inf, 1.0)):
        llama_backward(model, llama_tokens(rank, step))
        r = assert_clips_as_torch(opt, gather, p, f"{what} norm {p}")
        if os.environ.get("HYBRID_PRINT_NORMS"):
            print(f"{what} norm {p}: {r}")
        opt.step()
        opt.zero_grad()


CLIP_CASES = {
    "clip_norm[2-three_buckets_view]": functools.partial(clip_norm, norm_type=2.0, ddp="three_buckets_view"),
    "clip_norm[2-two_buckets-flat_collectives]": functools.partial(clip_norm, norm_type=2.0, ddp="two_buckets",
                                                                  flat=True),
    "clip_norm[1-default]": functools.partial(clip_norm, norm_type=1.0, ddp="default"),
    "clip_norm[inf-three_buckets_view]": functools.partial(clip_norm, norm_type=math.inf, ddp="three_buckets_view"),
    "clip_value": clip_value,
    "measure_only": measure_only,
    "torch_clip_refused": torch_clip_refused,
    "clip_norm_llama[one_bucket]": functools.partial(clip_norm_llama, bucket_cap_mb=None, dtype=torch.float32),
    "clip_norm_llama[buckets]": functools.partial(clip_norm_llama, bucket_cap_mb=0.2, dtype=torch.float32),
    "clip_norm_llama[bfloat16]": functools.partial(clip_norm_llama, bucket_cap_mb=None, dtype=torch.bfloat16),
}
