"""The pair every ZeRO2 case runs: hybrid's DDP + ZeRO2 and torch's DDP + the plain optimizer.

Tolerances: rtol 1.3e-6 / atol 1e-6 (torch's float32 defaults for ``assert_close``). Both sides
run the same elementwise optimizer math in float32; what differs is the reduction (a reduce-scatter
of ``grad / world_size`` against DDP's all-reduce of ``grad * (1 / world_size)``, either of which
may round the last bit differently) and the grouping of elements into foreach kernels.
"""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import DistributedDataParallel, GradientInShards, ZeRO2
from tests.torch_zero._cases import OPTIMIZERS, make_model

RTOL, ATOL = 1.3e-6, 1e-6
NUM_STEPS = 4
STATE_COPIES = {"adam": 2, "adamw": 2, "sgd_momentum": 1}

# DDP options: the bucket layouts differ (one bucket; two after the rebuild; three from the start).
DDP_OPTIONS = {
    "default": {},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "two_buckets": {"bucket_cap_mb": 0.0002},
    "three_buckets_view": {"bucket_cap_mb_list": [0.0001, 0.0002], "gradient_as_bucket_view": True},
    "three_buckets_static": {"bucket_cap_mb_list": [0.0001, 0.0002], "static_graph": True},
    "four_buckets": {"bucket_cap_mb_list": [0.00005, 0.0001]},
}


# Two parameter groups (weights, biases) per optimizer: different options per group, and for SGD
# a group without momentum, so one group keeps state and the other none.
GROUP_OPTIONS = {
    "adam": ({"lr": 0.02}, {"lr": 0.005}),
    "adamw": ({"weight_decay": 0.1}, {"weight_decay": 0.0, "lr": 0.02}),
    "sgd_momentum": ({"momentum": 0.9}, {"momentum": 0.0, "lr": 0.1}),
}


def two_groups(model: torch.nn.Module, optim: str) -> list[dict]:
    weights, biases = GROUP_OPTIONS[optim]
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], **weights},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], **biases}]


class OptimizerPair:
    """What the ZeRO2 and ZeRO3 pairs share: hybrid's wrapped model (``self.wrapped``) and optimizer
    (``self.opt``) against torch's DDP (``self.ref_ddp``) and the plain optimizer (``self.ref_opt``),
    over copies of one model (``self.model``, ``self.ref_model``)."""

    def _optimizers(self, make, optim: str, groups: bool, kwargs: dict) -> None:
        """``self.opt = make(cls, ...)`` and the plain ``cls`` beside it, with two parameter groups or one."""
        cls = OPTIMIZERS[optim][0]
        if groups:
            self.opt = make(cls, param_groups=two_groups(self.model, optim), **kwargs)
            self.ref_opt = cls(two_groups(self.ref_model, optim), **kwargs)
        else:
            self.opt = make(cls, **kwargs)
            self.ref_opt = cls(self.ref_model.parameters(), **kwargs)
        # SGD's momentum-free group keeps no state: the count check needs every element to have some.
        self.copies = None if groups and optim == "sgd_momentum" else STATE_COPIES[optim]

    def backward(self, x):
        self.wrapped(x).pow(2).mean().backward()
        self.ref_ddp(x).pow(2).mean().backward()

    def step(self):
        self.opt.step()
        self.ref_opt.step()
        self.opt.zero_grad()
        self.ref_opt.zero_grad()

    def closure_step(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """One step with a closure on our side, the plain loop on torch's: both losses."""
        def loss_fn():
            loss = self.wrapped(x).pow(2).mean()
            loss.backward()
            return loss
        loss = self.opt.step(loss_fn)
        ref_loss = self.ref_ddp(x).pow(2).mean()
        ref_loss.backward()
        self.ref_opt.step()
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        return loss, ref_loss


class Pair(OptimizerPair):
    """The same model under hybrid DDP + ZeRO2 and under torch DDP + the plain optimizer."""

    def __init__(self, optim: str, ddp_options: dict, *, flat: bool = False, groups: bool = False, **extra):
        kwargs = {**OPTIMIZERS[optim][1], **extra}
        base = make_model()
        self.model, self.ref_model = copy.deepcopy(base), copy.deepcopy(base)
        self.ddp = DistributedDataParallel(self.model, **ddp_options)
        self.ref_ddp = TorchDDP(self.ref_model, **ddp_options)
        self.wrapped = self.ddp
        self._optimizers(lambda cls, **kw: ZeRO2(self.ddp, cls, **kw), optim, groups, kwargs)
        # On gloo ZeRO2 all-reduces and slices; flat=True forces the reduce-scatter/all-gather
        # path it takes on other backends, so both are checked here.
        self.opt._flat_collectives = flat

    def check(self, what: str):
        for (name, p), q in zip(self.model.named_parameters(), self.ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")

    def check_sharded(self, world_size: int, what: str):
        """Between backward and step: no full gradients, only this rank's slices."""
        assert all(isinstance(p.grad, GradientInShards) for p in self.model.parameters()), \
            f"{what}: a full .grad survived"
        padded = sum(-(-b.length // world_size) for b in self.ddp.bucket_plan.buckets)
        assert self.opt.grad_numel() == padded, f"{what}: {self.opt.grad_numel()} gradient elements != {padded}"

    def check_state(self, world_size: int, what: str):
        if self.copies is None:
            return
        padded = sum(-(-b.length // world_size) for b in self.ddp.bucket_plan.buckets)
        assert self.opt.state_numel() == self.copies * padded, \
            f"{what}: {self.opt.state_numel()} state elements != {self.copies} x {padded}"
