"""The pair every ZeRO3 case runs: hybrid's ZeRO3 + ZeRO3Optimizer and torch's DDP + the plain
optimizer, built from the same model and fed the same batches.

Tolerance: bit equality at world sizes 1 and 2, as torch's FSDP2 gives. The forward and backward
run the same ops on the same parameter values; gradients are divided by the world size and summed
over the ranks on both sides, and a sum of two floats does not depend on their order; the
optimizers are elementwise, so a flat slice updates each element as its own tensor would. At 3
ranks gloo's all-reduce adds each element's three terms in an order that depends on where the
element sits in the buffer, and the buckets differ from DDP's: rtol 1.3e-6 / atol 1e-6 there
(torch's float32 defaults for ``assert_close``), measured differences are ~3e-8.
"""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import GradientInShards, ZeRO3, ZeRO3Optimizer
from tests.torch_zero._cases import OPTIMIZERS, make_model
from tests.torch_zero2._pair import OptimizerPair

RTOL, ATOL = 1.3e-6, 1e-6

# ZeRO3 layouts: the default plan (one bucket for this small model), several buckets, prefetch
# depths, the forward's buckets kept for the backward, the flat collectives of other backends.
LAYOUTS = {
    "default": {},
    "four_buckets": {"bucket_cap_mb": 0.0001},
    "four_buckets_no_prefetch": {"bucket_cap_mb": 0.0001, "prefetch": 0},
    "six_buckets_prefetch_3": {"bucket_cap_mb": 0.00004, "prefetch": 3},
    "four_buckets_kept": {"bucket_cap_mb": 0.0001, "reshard_after_forward": False},
    "four_buckets_flat": {"bucket_cap_mb": 0.0001, "flat": True},
    "memory_policy": {"policy": "memory"},  # a bucket per module, nothing kept for the backward
}

def use_flat_collectives(model: ZeRO3) -> None:
    """all-gather / reduce-scatter, as on NCCL, instead of gloo's faster broadcasts / all-reduce."""
    model._buckets.flat_collectives = model._grads.flat_collectives = True


class Pair(OptimizerPair):
    """The same model under ZeRO3 + ZeRO3Optimizer and under torch DDP + the plain optimizer."""

    def __init__(self, optim: str, layout: dict, *, groups: bool = False, model: torch.nn.Module | None = None,
                 zero3_options=None, optimizer_options: dict | None = None, **extra):
        """``zero3_options(model)``: more ZeRO3 arguments for the copy it wraps (``external_params``);
        ``optimizer_options``: more ZeRO3Optimizer arguments (``step_in_backward``)."""
        kwargs = {**OPTIMIZERS[optim][1], **extra}
        layout = dict(layout)
        flat = layout.pop("flat", False)
        base = make_model() if model is None else model
        self.model, self.ref_model = copy.deepcopy(base), copy.deepcopy(base)
        self.zero = ZeRO3(self.model, **layout, **(zero3_options(self.model) if zero3_options else {}))
        if flat:
            use_flat_collectives(self.zero)
        self.ref_ddp = TorchDDP(self.ref_model)
        self.wrapped = self.zero
        self._optimizers(lambda cls, **kw: ZeRO3Optimizer(self.zero, cls, **kw, **(optimizer_options or {})),
                         optim, groups, kwargs)

    def check(self, world_size: int, what: str, *, exact: bool = True):
        """Every parameter (gathered: a collective) equal to the reference's, bit for bit at 1
        and 2 ranks (see the module docstring) unless ``exact=False``."""
        ours = self.zero.state_dict()
        for name, q in self.ref_model.state_dict().items():
            p = ours[f"module.{name}"]
            if exact and world_size <= 2:
                assert torch.equal(p, q), f"{what}: {name} differs by {(p - q).abs().max().item():.3g}"
            else:
                torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")

    def check_sharded(self, world_size: int, what: str):
        """Between backward and step: no full gradient, only this rank's slices."""
        assert all(isinstance(p.grad, GradientInShards) for p in self.model.parameters() if p.requires_grad), \
            f"{what}: a full .grad survived"
        padded = sum(self.zero.shards.shard_sizes)
        assert padded == sum(-(-b.length // world_size) for b in self.zero.bucket_plan.buckets)
        assert self.opt.grad_numel() == padded, f"{what}: {self.opt.grad_numel()} gradient elements != {padded}"

    def check_state(self, what: str):
        if self.copies is None:
            return
        padded = sum(self.zero.shards.shard_sizes)
        assert self.opt.state_numel() == self.copies * padded, \
            f"{what}: {self.opt.state_numel()} state elements != {self.copies} x {padded}"
