"""ZeRO2's clipping against torch's ``clip_grad_norm_`` / ``clip_grad_value_`` on DDP's unsharded
gradients, and torch's own clip functions refusing the sharded ones.

SGD with momentum (a step proportional to the clipped gradient; Adam would hide the scale).
Tolerances: parameters as in ``_pair`` (rtol 1.3e-6, atol 1e-6); the total norm rtol 1.3e-6: both
sides sum the same float32 squares (of the same averaged gradients), in a different order.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

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


CLIP_CASES = {
    "clip_norm[2-three_buckets_view]": functools.partial(clip_norm, norm_type=2.0, ddp="three_buckets_view"),
    "clip_norm[2-two_buckets-flat_collectives]": functools.partial(clip_norm, norm_type=2.0, ddp="two_buckets",
                                                                  flat=True),
    "clip_norm[1-default]": functools.partial(clip_norm, norm_type=1.0, ddp="default"),
    "clip_norm[inf-three_buckets_view]": functools.partial(clip_norm, norm_type=math.inf, ddp="three_buckets_view"),
    "clip_value": clip_value,
    "measure_only": measure_only,
    "torch_clip_refused": torch_clip_refused,
}
