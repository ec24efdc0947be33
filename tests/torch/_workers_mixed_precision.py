"""Worker processes for tests/torch/test_ddp_mixed_precision.py: torch's DDP and ours with
``mixed_precision=_MixedPrecision(...)``, one after the other in the same gloo processes.

torch 2.13's mixed precision records CUDA-style events around its low-precision copies, and on
CPU ``torch.Event().record()`` raises "cpu backend doesn't support events"; everything else it does
runs on CPU. ``_cpu_events()`` stands in no-op events and a no-op current stream (CPU work is
synchronous, there is nothing to wait for), so torch's own class runs unchanged otherwise.
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision

from _workers import _data, _init, side_by_side
from hybrid.torch import DistributedDataParallel as HybridDDP

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class _CpuEvent:
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass


class _CpuStream:
    def wait_stream(self, other):
        pass


def _cpu_events():
    torch.Event = _CpuEvent
    torch.accelerator.current_stream = lambda device=None: _CpuStream()


class Net(nn.Module):
    """Two linear layers, a BatchNorm between them (its buffers cast to buffer_dtype), a parameter
    that does not require grad (cast for the forward, in no bucket) and a plain buffer."""

    def __init__(self, bn=True):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc2 = nn.Linear(16, 4)
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 4), requires_grad=False)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) + self.frozen


def _model(rank, bn=True):
    torch.manual_seed(0)
    model = Net(bn)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)  # different per rank: DDP's initial broadcast must fix it
    return model


def _loss(out, y):
    return ((out.float() - y) ** 2).mean()


def _grads(ddp):
    return [None if p.grad is None else p.grad.detach().clone() for p in ddp.module.parameters()]


def _state(ddp):
    return {"params": [p.detach().clone() for p in ddp.module.parameters()],
            "buffers": [b.detach().clone() for b in ddp.module.buffers()]}


def train(cls, rank, world, mp, bn, opt_name, warmup, kwargs):
    """``warmup`` forward/backward passes on one batch without a step (torch's gradients are
    wrong until its buckets are rebuilt: the test checks ours against its last warm-up pass),
    then four steps of SGD with momentum or Adam on the full-precision parameters."""
    ddp = cls(_model(rank, bn), mixed_precision=_MixedPrecision(*mp), **kwargs)
    out = {"setup": {"mp_dtypes": [p._mp_param.dtype for p in ddp.module.parameters()],
                     "fp_dtypes": [p._fp_param.dtype for p in ddp.module.parameters()],
                     "buffer_dtypes": [b.dtype for b in ddp.module.buffers()]}}
    x, y = _data(rank, 0, "mlp")
    out["warmup"] = []
    for _ in range(warmup):
        _loss(ddp(x), y).backward()
        out["warmup"].append(_grads(ddp))
        ddp.zero_grad(set_to_none=True)
    opt = (torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(ddp.parameters(), lr=1e-2))
    out["steps"] = []
    for step in range(1, 5):
        x, y = _data(rank, step, "mlp")
        y_hat = ddp(x)
        seen = {"out_dtype": y_hat.dtype, "dtypes_in_forward": [p.dtype for p in ddp.module.parameters()]}
        _loss(y_hat, y).backward()
        seen["dtypes_after_backward"] = [p.dtype for p in ddp.module.parameters()]
        seen["grads"] = _grads(ddp)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # zeros kept: cast down and up by the next pass
        seen.update(_state(ddp))
        out["steps"].append(seen)
    # An eval forward with grad enabled and no backward leaves the low-precision copies in place
    # (torch's behaviour); ours also runs a forward under no_grad (torch 2.13 raises there).
    ddp.eval()
    x, _ = _data(rank, 9, "mlp")
    out["eval"] = ddp(x).detach()
    if cls is HybridDDP:
        with torch.no_grad():
            out["no_grad"] = ddp(x)
        out["after_no_grad"] = [(p.dtype, p.detach().clone()) for p in ddp.module.parameters()]
    return out


def reference_first_grads(rank, world, mp, bn):
    """Single-process reference for the first pass, torch aside: each rank's gradient of a
    low-precision copy of rank 0's model, averaged over ranks in float64."""
    model = _model(0, bn)
    for p in model.parameters():
        p.data = p.data.to(mp[0])
    for b in model.buffers():
        b.data = b.to(mp[2])
    x, y = _data(rank, 0, "mlp")
    _loss(model(x.to(mp[0])), y).backward()
    grads = []
    for p in model.parameters():
        if p.grad is None:
            grads.append(None)
            continue
        every = [torch.zeros_like(p.grad, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, p.grad.to(torch.float64))
        grads.append(sum(every) / world)
    return grads


def combination(cls, rank, world, mp, kwargs, action):
    """A combination with another feature: what happens, torch's class or ours."""
    ddp = cls(_model(rank), mixed_precision=_MixedPrecision(*mp), **kwargs)
    x, y = _data(rank, 0, "mlp")
    if action == "no_sync":
        with ddp.no_sync():
            _loss(ddp(x), y).backward()
        _loss(ddp(x), y).backward()
    elif action == "comm_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif action == "builtin_hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif action in ("pickle", "deepcopy"):
        _loss(ddp(x), y).backward()
        pickle.dumps(ddp) if action == "pickle" else copy.deepcopy(ddp)
    elif action == "no_grad":
        with torch.no_grad():
            ddp(x)
    else:  # a plain training step: the combination is accepted at construction
        _loss(ddp(x), y).backward()
    return "ok"


def ignored(cls, rank, world):
    """torch's test_ddp_native_mixed_precision_ignored_params: what is ignored is not cast."""
    model = _model(rank)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(model, ["fc1.weight", "seen"])
    ddp = cls(model, mixed_precision=_MixedPrecision(F16, F16, F16))
    return {n: (hasattr(p, "_mp_param"), hasattr(p, "_fp_param"), p.dtype)
            for n, p in list(ddp.module.named_parameters()) + list(ddp.module.named_buffers())}


def disagree(cls, rank, world):
    """Rank 0 reduces in bfloat16, the others in float32: the bucket layouts would differ."""
    if cls is TorchDDP:
        return "not checked by torch"
    reduce_dtype = BF16 if rank == 0 else F32
    cls(_model(rank), mixed_precision=_MixedPrecision(BF16, reduce_dtype, BF16))
    return "ok"


_CONFIGS = {"bf16": (BF16, BF16, BF16), "f16_f32": (F16, F32, F16), "bf16_f32": (BF16, F32, BF16),
            "f16": (F16, F16, F16)}
CASES = {}
for _name, _mp in _CONFIGS.items():
    CASES[f"train_{_name}_sgd"] = (train, (_mp, True, "sgd", 2, {}))
    CASES[f"train_{_name}_adam"] = (train, (_mp, True, "adam", 2, {}))
CASES["train_bf16_view"] = (train, (_CONFIGS["bf16"], True, "sgd", 2, {"gradient_as_bucket_view": True}))
CASES["train_f16_f32_view"] = (train, (_CONFIGS["f16_f32"], True, "adam", 2, {"gradient_as_bucket_view": True}))
CASES["train_bf16_f32_static"] = (train, (_CONFIGS["bf16_f32"], True, "sgd", 3, {"static_graph": True}))
# Buffers left in float32 (a BatchNorm would refuse float16 inputs against float32 stats).
CASES["train_f16_f32_f32_nobn"] = (train, ((F16, F32, F32), False, "adam", 2, {}))
# No reduce_dtype: reduced in param_dtype (torch's rule); no buffer_dtype: buffers left alone.
CASES["train_bf16_only_nobn"] = (train, ((BF16, None, None), False, "sgd", 2, {}))
for _action, _kwargs in (("no_sync", {}), ("comm_hook", {}), ("builtin_hook", {}), ("pickle", {}),
                         ("deepcopy", {}), ("no_grad", {}), ("step", {"find_unused_parameters": True})):
    CASES[f"with_{_action}"] = (combination, (_CONFIGS["bf16"], _kwargs, _action))
CASES["with_no_param_dtype"] = (combination, ((None, F16, None), {}, "step"))
CASES["ignored"] = (ignored, ())
CASES["disagree"] = (disagree, ())


def mixed_precision_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    _cpu_events()
    results = {}
    for name in case_names:
        fn, args = CASES[name]
        results[name] = side_by_side(fn, rank, world, *args)
        if fn is train:
            results[name]["reference"] = reference_first_grads(rank, world, args[0], args[1])
    torch.save(results, os.path.join(outdir, f"mixed_precision_rank{rank}.pt"))
    dist.destroy_process_group()
