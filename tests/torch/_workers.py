"""Worker processes for the multi-process DDP tests: torch's DDP (oracle) and ours, same process.

Every case runs torch's DDP and hybrid's DDP one after the other in the SAME worker processes
(same seeds, different data per rank), so process start-up is paid once per world size. Results
(parameters, bucket membership, errors) are saved per rank for the test process to compare.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import DistributedDataParallel as HybridDDP


class MLP(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        dims = [8] + [width] * (depth - 1) + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(),
                                 nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 4))

    def forward(self, x):
        return self.net(x.view(-1, 2, 8, 8)[:, :, :, :])


class Unused(nn.Module):
    """``never`` is unused on every rank, ``sometimes`` only on ranks passing use_extra=False."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.never = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, use_extra=False):
        h = torch.relu(self.a(x))
        if use_extra:
            h = h + self.sometimes(h)
        return self.b(h)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x)).double()
        return self.c(torch.relu(self.b(h)).float())


@dataclasses.dataclass
class Out:
    main: torch.Tensor
    extras: dict


Pair = collections.namedtuple("Pair", "left right")


class Structured(Unused):
    """Returns a dataclass holding a dict of lists of namedtuples (torch's _find_tensors walks
    them all); ``never`` is unused, ``sometimes`` is used on rank 0 only."""

    def forward(self, x, use_extra=False):
        h = torch.relu(self.a(x))
        side = self.sometimes(h).sum(1, keepdim=True) if use_extra else torch.zeros(len(x), 1)
        return Out(self.b(h), {"aux": [Pair(side, h.detach())]})


class Heads(Unused):
    """Three heads; the loss takes the side head (``sometimes``) on ranks passing use_extra=True
    only, and the ``never`` head on no rank. With find_unused_parameters, both are reachable from
    the outputs, and torch's sink hands their hooks a None gradient where the loss leaves them out:
    ``never.grad`` stays None everywhere, ``sometimes`` gets rank 0's gradient reduced."""

    def forward(self, x, use_extra=False):
        h = torch.relu(self.a(x))
        return self.b(h), self.sometimes(h), self.never(h), use_extra


def _loss(out, y):
    if isinstance(out, tuple):  # Heads
        main, side, _, use_side = out
        return ((main - y) ** 2).mean() + (0.1 * side.mean() if use_side else 0.0)
    if isinstance(out, Out):
        return ((out.main - y) ** 2).mean() + 0.1 * out.extras["aux"][0].left.mean()
    return ((out - y) ** 2).mean()


MODELS = {"mlp": MLP, "structured": Structured, "heads": Heads, "conv_bn": ConvBN, "unused": Unused, "mixed": Mixed,
          "wide": lambda: MLP(width=64, depth=5),
          # 300 x 300 weights: above BucketBuffers.FUSED_SCALE_NUMEL, so gradients
          # are scaled while copied; biases and the small layers take the per-bucket path.
          "large": lambda: MLP(width=300, depth=3)}

def _bf16_hook(state, bucket):
    return default_hooks.bf16_compress_hook(state, bucket)


HOOKS = {
    "allreduce_hook": lambda: (None, default_hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
    # torch refuses a hook *named* bf16_compress_hook without CUDA/NCCL; the same function under
    # another name runs on gloo, for torch's DDP and ours alike.
    "bf16_compress_hook": lambda: (None, _bf16_hook),
    "powerSGD_hook": lambda: (psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                 min_compression_rate=0.5), psgd.powerSGD_hook),
    "batched_powerSGD_hook": lambda: (psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                                      psgd.batched_powerSGD_hook),
    # torch 2.13's batched hook can only run its warm-up phase: from start_powerSGD_iter on it
    # calls _orthogonalize on the 2-D Q matrix, which asserts a 3-D batch, for every shape and rank.
    # Started after the last step, every step is its vanilla all-reduce (and iteration counting).
    "batched_powerSGD_hook_warmup": lambda: (
        psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=STEPS + 1),
        psgd.batched_powerSGD_hook),
}

# name -> (model, ddp kwargs, options)
CASES = {
    "mlp": ("mlp", {}, {}),
    "conv_bn": ("conv_bn", {}, {}),
    "grad_view": ("mlp", {"gradient_as_bucket_view": True}, {}),
    "conv_bn_grad_view": ("conv_bn", {"gradient_as_bucket_view": True}, {}),
    "mixed_dtypes": ("mixed", {}, {}),
    "many_buckets": ("wide", {"bucket_cap_mb": 0.004}, {}),
    "many_buckets_view": ("wide", {"bucket_cap_mb": 0.004, "gradient_as_bucket_view": True}, {}),
    "large_tensors": ("large", {}, {}),
    "large_tensors_view": ("large", {"gradient_as_bucket_view": True}, {}),
    "large_tensors_many_buckets": ("large", {"bucket_cap_mb": 0.1}, {}),
    "bucket_cap_mb_list": ("wide", {"bucket_cap_mb_list": [0.004, 0.01]}, {}),
    "membership": ("wide", {"bucket_cap_mb": 0.004}, {"hook": "record"}),
    "membership_default_caps": ("wide", {}, {"hook": "record"}),
    "find_unused": ("unused", {"find_unused_parameters": True}, {}),
    "find_unused_dataclass": ("structured", {"find_unused_parameters": True}, {}),
    "find_unused_view": ("unused", {"find_unused_parameters": True, "gradient_as_bucket_view": True}, {}),
    # An output the loss leaves out (on ranks other than 0): torch's _DDPSink, .grad left as None.
    "find_unused_outputs": ("heads", {"find_unused_parameters": True}, {}),
    "find_unused_outputs_view": ("heads", {"find_unused_parameters": True, "gradient_as_bucket_view": True}, {}),
    "find_unused_outputs_no_sync": ("heads", {"find_unused_parameters": True}, {"accumulate": 2}),
    "static_graph": ("mlp", {"static_graph": True}, {}),
    "static_graph_unused": ("unused", {"static_graph": True}, {}),
    "static_graph_view": ("wide", {"static_graph": True, "gradient_as_bucket_view": True,
                                   "bucket_cap_mb": 0.004}, {}),
    "no_sync": ("mlp", {}, {"accumulate": 2}),
    "no_sync_view": ("mlp", {"gradient_as_bucket_view": True}, {"accumulate": 2}),
    # torch decides at forward time: a forward outside no_sync() is reduced even when its
    # backward runs inside the block.
    "no_sync_backward_inside": ("mlp", {}, {"accumulate": 2, "backward_in_no_sync": True}),
    # A negative cap is unlimited in torch: one bucket.
    "negative_cap": ("wide", {"bucket_cap_mb": -1}, {"hook": "record"}),
    "no_buffer_sync": ("conv_bn", {"broadcast_buffers": False}, {}),
    **{f"hook_{h}": ("wide", {"bucket_cap_mb": 0.01}, {"hook": h}) for h in HOOKS if "power" not in h},
    # PowerSGD chains collectives in Future callbacks that run on gloo's threads; with several
    # buckets their issue order can differ between ranks (for torch's reducer too), so one bucket.
    **{f"hook_{h}": ("wide", {}, {"hook": h}) for h in HOOKS if "power" in h},
    "join": ("mlp", {}, {"uneven": True}),
    "join_no_divide": ("mlp", {}, {"uneven": True, "divide_by_initial_world_size": False}),
    "join_conv_bn": ("conv_bn", {}, {"uneven": True}),
    # A joined rank runs the comm hook on zero buckets (torch's _match_all_reduce_for_bwd_pass):
    # the fp16 hook's collective differs from a plain all-reduce in dtype and size.
    "join_hook_fp16": ("wide", {"bucket_cap_mb": 0.01}, {"uneven": True, "hook": "fp16_compress_hook"}),
    "join_hook_record": ("wide", {"bucket_cap_mb": 0.01}, {"uneven": True, "hook": "record"}),
}

STEPS = 4


def _data(rank, step, model_name):
    g = torch.Generator().manual_seed(1000 * rank + step)
    n_in = 128 if model_name == "conv_bn" else 8
    return torch.randn(6, n_in, generator=g), torch.randn(6, 4, generator=g)


def _record_hook(log):
    def hook(state, bucket):
        log.append((bucket.index(), [id(p) for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def _train(ddp_cls, model, kwargs, opts, rank, world, model_name):
    ddp = ddp_cls(model, **kwargs)
    log = []
    hook = opts.get("hook")
    if hook == "record":
        ddp.register_comm_hook(None, _record_hook(log))
    hook_state = None
    if hook not in (None, "record"):
        hook_state, hook_fn = HOOKS[hook]()
        ddp.register_comm_hook(hook_state, hook_fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    steps = STEPS + rank if opts.get("uneven") else STEPS
    fwd_kwargs = {"use_extra": rank == 0} if model_name in ("unused", "structured", "heads") else {}
    ctx = (ddp.join(divide_by_initial_world_size=opts.get("divide_by_initial_world_size", True))
           if opts.get("uneven") else _nullcontext())
    with ctx:
        for step in range(steps):
            accumulate = opts.get("accumulate", 1)
            for micro in range(accumulate):
                x, y = _data(rank, 10 * step + micro, model_name)
                if micro < accumulate - 1:
                    with ddp.no_sync():
                        _loss(ddp(x, **fwd_kwargs), y).backward()
                elif opts.get("backward_in_no_sync"):
                    loss = _loss(ddp(x, **fwd_kwargs), y)
                    with ddp.no_sync():
                        loss.backward()
                else:
                    _loss(ddp(x, **fwd_kwargs), y).backward()
            grads_none = [p.grad is None for p in ddp.module.parameters()]
            opt.step()
            opt.zero_grad()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    membership = {}
    for b, ids in log:  # the last iteration's buckets (after the rebuild)
        membership[b] = [index[i] for i in ids]
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "membership": [membership[b] for b in sorted(membership)],
            "grads_none": grads_none,
            "hook_iter": getattr(hook_state, "iter", None),
            "plan": ddp.bucket_plan.bucket_indices() if hasattr(ddp, "bucket_plan") else None}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _init(rank, world, port, timeout_s=30):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def side_by_side(fn, rank, world, *args):
    """``fn(cls, rank, world, *args)`` under torch's DDP class, then ours, in this process:
    ``{"torch": ..., "hybrid": ...}``, each ``{"result": ...}`` or ``{"error": (type, text),
    "traceback": ...}``, with the warnings it raised (FutureWarning and DeprecationWarning aside).
    Where one fails it fails on every rank at the same collective: a barrier realigns the ranks."""
    out = {}
    for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out[label] = {"result": fn(cls, rank, world, *args)}
            except Exception as e:  # noqa: BLE001 - compared with torch's outcome by the test
                out[label] = {"error": (type(e).__name__, str(e)), "traceback": traceback.format_exc()}
        out[label]["warnings"] = [str(w.message) for w in caught
                                  if not issubclass(w.category, (FutureWarning, DeprecationWarning))]
        dist.barrier()
    return out


def parity_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    results = {}
    for name in case_names:
        model_name, kwargs, opts = CASES[name]
        out = {}
        for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
            torch.manual_seed(0)
            model = MODELS[model_name]()
            # Different initial parameters per rank: the initial broadcast must fix them.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(rank * 0.01)
            try:
                out[label] = _train(cls, model, dict(kwargs), opts, rank, world, model_name)
            except Exception as e:  # noqa: BLE001 - compared with the oracle's outcome by the test
                out[label] = {"error": (type(e).__name__, str(e)[:300]), "traceback": traceback.format_exc()}
            dist.barrier()
        results[name] = out
    if world > 1:  # in this spawn too: a spawn of its own costs more than the case
        results["join_throw"] = _join_throw(rank)
    torch.save(results, os.path.join(outdir, f"parity_rank{rank}.pt"))
    dist.destroy_process_group()


def _expect(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return (type(e).__name__, str(e))
    return None


def _join_throw(rank):
    """Uneven inputs (rank r has STEPS + r batches) under ``join(throw_on_early_termination=True)``:
    torch's DDP, then ours; what each rank raises, after how many steps, and the parameters then."""
    res = {}
    for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
        torch.manual_seed(0)
        model = MLP()
        ddp = cls(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        done = []

        def run():
            with ddp.join(throw_on_early_termination=True):
                for step in range(STEPS + rank):
                    x, y = _data(rank, step, "mlp")
                    ((ddp(x) - y) ** 2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    done.append(step)
        res[label] = {"error": _expect(run), "steps": len(done),
                      "params": [p.detach().clone() for p in model.parameters()]}
        dist.barrier()
    return res
