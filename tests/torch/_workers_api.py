"""Worker processes for tests/torch/test_ddp_api.py: torch DDP's remaining APIs (issue 15) -
``_register_fused_optim``, ``_register_buffer_comm_hook``, ``delay_all_reduce_named_params`` and
``device_mesh`` - run under torch's class and ours one after the other in the same gloo
processes, results saved per rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel.distributed import _BufferCommHookLocation

from _workers import MLP, ConvBN, _data, _init, _loss, side_by_side
from hybrid.torch import DistributedDataParallel as HybridDDP

STEPS = 4
OPTIMS = {"SGD": (torch.optim.SGD, (0.05,), {"momentum": 0.9, "weight_decay": 0.01}),
          "Adam": (torch.optim.Adam, (0.01,), {"betas": (0.9, 0.99), "eps": 1e-6})}


def _model(name, rank):
    torch.manual_seed(0)
    model = {"mlp": MLP, "conv_bn": ConvBN, "wide": lambda: MLP(width=64, depth=5)}[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)  # different per rank: DDP's initial broadcast must fix it
    return model


def _train_mlp(ddp, opt, rank):
    """STEPS plain steps on the "mlp" data; the snapshot after them."""
    for step in range(STEPS):
        x, y = _data(rank, step, "mlp")
        _loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _snapshot(ddp)


def _snapshot(ddp):
    return {"params": [p.detach().clone() for p in ddp.module.parameters()],
            "buffers": [b.detach().clone() for b in ddp.module.buffers()]}


def _grads(module):
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


# ---- _register_fused_optim ------------------------------------------------------------------

def fused(cls, rank, world, optim, kwargs, subset=False):
    """Steps inside the backward, then the same steps with the optimizer after backward() on a
    second DDP of the same class: both must end equal (torch's own parity test)."""
    optim_cls, args, okw = OPTIMS[optim]
    ddp = cls(_model("wide", rank), bucket_cap_mb=0.01, **kwargs)
    initial = [p.detach().clone() for p in ddp.module.parameters()]
    params = [next(iter(ddp.module.parameters()))] if subset else None
    ddp._register_fused_optim(optim_cls, *args, optim_params=params, **okw)
    grads = []
    for step in range(STEPS):
        ddp.zero_grad()
        x, y = _data(rank, step, "mlp")
        _loss(ddp(x), y).backward()
        grads.append(_grads(ddp.module))
    plain = cls(_model("wide", rank), bucket_cap_mb=0.01, **kwargs)
    opt = optim_cls([next(iter(plain.module.parameters()))] if subset else plain.parameters(), *args, **okw)
    for step in range(STEPS):
        plain.zero_grad()
        x, y = _data(rank, step, "mlp")
        _loss(plain(x), y).backward()
        opt.step()
    return {**_snapshot(ddp), "grads": grads, "initial": initial,
            "plain": [p.detach().clone() for p in plain.module.parameters()]}


def _allreduce(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)


def fused_and_hook(cls, rank, world, hook_first):
    """torch: the fused optimizer is a comm hook, and a DDP has one comm hook at most."""
    ddp = cls(_model("mlp", rank))
    if hook_first:
        ddp.register_comm_hook(None, _allreduce)
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
    else:
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
        ddp.register_comm_hook(None, _allreduce)


class _Recorder:
    """A functional optimizer that records what ``_hook_then_optimizer``'s callback hands it."""

    def __init__(self, index):
        self.index, self.seen = index, {}

    def step_param(self, param, grad):
        self.seen[self.index[id(param)]] = grad.detach().clone()


def fused_callback_view(cls, rank, world):
    """torch's ``_hook_then_optimizer`` over allreduce_hook, with a recording optimizer: each
    parameter's gradient as the Future's then-callback sees it, per step."""
    from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        _hook_then_optimizer, _OptimizerHookState)
    ddp = cls(_model("wide", rank), bucket_cap_mb=0.01)
    recorder = _Recorder({id(p): i for i, p in enumerate(ddp.module.parameters())})
    ddp.register_comm_hook(None, _hook_then_optimizer(default_hooks.allreduce_hook, _OptimizerHookState(recorder)))
    seen = []
    for step in range(STEPS):
        recorder.seen = {}
        x, y = _data(rank, step, "mlp")
        _loss(ddp(x), y).backward()
        seen.append([recorder.seen.get(i) for i in range(len(recorder.index))])
    return {"seen": seen, "grads": _grads(ddp.module)}


def fused_unknown_optim(cls, rank, world):
    cls(_model("mlp", rank))._register_fused_optim(torch.optim.LBFGS, 0.1)


# ---- _register_buffer_comm_hook -------------------------------------------------------------

def _average_buffers(ddp, named_buffers):
    """torch's test hook, averaged: all-reduce every buffer, return the futures."""
    n = dist.get_world_size(ddp.process_group)
    futs = []
    for b in named_buffers.values():
        if b.is_floating_point():
            b.div_(n)
        futs.append(dist.all_reduce(b, group=ddp.process_group, async_op=True).get_future())
    return futs


def _average_buffers_sync(ddp, named_buffers):
    torch.futures.wait_all(_average_buffers(ddp, named_buffers))


def _broadcast_buffers(ddp, named_buffers):
    ddp._default_broadcast_coalesced(list(named_buffers.values()))


BUFFER_HOOKS = {"average": _average_buffers, "average_sync": _average_buffers_sync,
                "broadcast": _broadcast_buffers}


def buffer_hook(cls, rank, world, hook, location, eval_between=False):
    """A BatchNorm model whose buffers differ per rank (different data); after every forward
    (before its backward) and every step the buffers are recorded."""
    ddp = cls(_model("conv_bn", rank))
    if hook is not None:
        ddp._register_buffer_comm_hook(ddp, BUFFER_HOOKS[hook], getattr(_BufferCommHookLocation, location))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    after_forward, after_step = [], []
    for step in range(STEPS):
        x, y = _data(rank, step, "conv_bn")
        loss = _loss(ddp(x), y)
        if hook != "average":  # with futures returned, torch waits for them only after backward
            after_forward.append([b.detach().clone() for b in ddp.module.buffers()])
        loss.backward()
        opt.step()
        opt.zero_grad()
        after_step.append([b.detach().clone() for b in ddp.module.buffers()])
        if eval_between:
            with torch.no_grad():
                ddp(_data(rank, 100 + step, "conv_bn")[0])
    return {**_snapshot(ddp), "after_forward": after_forward, "after_step": after_step}


def buffer_hook_not_callable(cls, rank, world):
    cls(_model("conv_bn", rank))._register_buffer_comm_hook(None, "not a hook")


# ---- delay_all_reduce_named_params ----------------------------------------------------------

def delay(cls, rank, world, delayed, hook_on, set_to_none=True, accumulate=1, ddp_kwargs=None):
    """MLP(depth 3) with the named parameters' all-reduce delayed until the gradient of
    ``hook_on`` is computed."""
    model = _model("mlp", rank)
    named = dict(model.named_parameters())
    delay_kwargs = {"delay_all_reduce_named_params": [(n, named[n]) for n in delayed],
                    "param_to_hook_all_reduce": named[hook_on]} if delayed else {}
    ddp = cls(model, **delay_kwargs, **(ddp_kwargs or {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = _data(rank, 10 * step + micro, "mlp")
            if micro < accumulate - 1:
                with ddp.no_sync():
                    _loss(ddp(x), y).backward()
            else:
                _loss(ddp(x), y).backward()
        # torch never waits for its delayed all-reduce: let it land before reading the gradients.
        dist.barrier()
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    ignored = sorted(getattr(ddp, "parameters_to_ignore", ()))
    return {**_snapshot(ddp), "grads": grads, "ignored": ignored,
            "planned": sorted(ddp._names[i] for b in ddp.bucket_plan.bucket_indices() for i in b)
            if isinstance(ddp, HybridDDP) else None}


def delay_all(cls, rank, world):
    """Every trainable parameter delayed (layer 1 and the first bias frozen), the all-reduce
    hooked on the parameter whose gradient comes last: torch 2.13's class builds no reducer and
    then fails in forward; ours runs."""
    model = _model("mlp", 0)  # the frozen layer is never broadcast without a reducer: same init
    model.layers[1].requires_grad_(False)
    model.layers[0].bias.requires_grad_(False)  # layers.0.weight's gradient comes last
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ddp = cls(model, delay_all_reduce_named_params=named, param_to_hook_all_reduce=model.layers[0].weight)
    opt = torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(rank, step, "mlp")
        _loss(ddp(x), y).backward()
        dist.barrier()
        opt.step()
        opt.zero_grad()
    return _snapshot(ddp)


def frozen_reference(cls, rank, world):
    """The reference for delay_all: plain DDP over the same model and frozen parameters."""
    model = _model("mlp", 0)  # the frozen layer is never broadcast without a reducer: same init
    model.layers[1].requires_grad_(False)
    model.layers[0].bias.requires_grad_(False)  # layers.0.weight's gradient comes last
    ddp = cls(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    return _train_mlp(ddp, opt, rank)


def delay_half_given(cls, rank, world):
    model = _model("mlp", rank)
    cls(model, delay_all_reduce_named_params=[("layers.2.weight", model.layers[2].weight)])


def delay_everything(cls, rank, world):
    model = _model("mlp", rank)
    cls(model, delay_all_reduce_named_params=list(model.named_parameters()),
        param_to_hook_all_reduce=model.layers[0].weight)


# ---- device_mesh ----------------------------------------------------------------------------

def mesh(cls, rank, world, shape, sliced=False):
    if sliced:
        device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("tp", "dp"))["dp"]
    else:
        device_mesh = init_device_mesh("cpu", shape)
    ddp = cls(_model("mlp", rank), device_mesh=device_mesh)
    assert ddp.device_mesh is device_mesh
    assert dist.get_world_size(ddp.process_group) == world
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return _train_mlp(ddp, opt, rank)


def mesh_and_group(cls, rank, world):
    cls(_model("mlp", rank), process_group=dist.group.WORLD, device_mesh=init_device_mesh("cpu", (world,)))


CASES = {
    **{f"fused_{o}": (fused, (o, {})) for o in OPTIMS},
    **{f"fused_{o}_subset": (fused, (o, {}, True)) for o in OPTIMS},
    "fused_SGD_view": (fused, ("SGD", {"gradient_as_bucket_view": True})),
    "fused_Adam_static": (fused, ("Adam", {"static_graph": True})),
    "fused_hook_first": (fused_and_hook, (True,)),
    "fused_hook_after": (fused_and_hook, (False,)),
    "fused_unknown_optim": (fused_unknown_optim, ()),
    "fused_callback_view": (fused_callback_view, ()),
    # A hook returning futures runs after the forward only: before it, or before a forward that
    # follows an eval forward's hook, its all-reduces race with the forward's own updates of the
    # running stats, for torch's class as for ours (torch's docs say so).
    "buffer_average_POST_FORWARD": (buffer_hook, ("average", "POST_FORWARD")),
    **{f"buffer_average_sync_{loc}": (buffer_hook, ("average_sync", loc)) for loc in ("PRE_FORWARD", "POST_FORWARD")},
    "buffer_average_sync_POST_FORWARD_eval": (buffer_hook, ("average_sync", "POST_FORWARD", True)),
    "buffer_broadcast_POST_FORWARD": (buffer_hook, ("broadcast", "POST_FORWARD")),
    "buffer_none": (buffer_hook, (None, None)),
    "buffer_not_callable": (buffer_hook_not_callable, ()),
    # The references: torch's plain DDP (delayed=None) averages the same gradients.
    "delay_none": (delay, (None, None)),
    "delay_none_no_sync": (delay, (None, None, True, 2)),
    "delay_none_static": (delay, (None, None, True, 1, {"static_graph": True})),
    "delay_last": (delay, (["layers.2.weight", "layers.2.bias"], "layers.0.weight")),
    "delay_last_zero_in_place": (delay, (["layers.2.weight", "layers.2.bias"], "layers.0.weight", False)),
    "delay_last_no_sync": (delay, (["layers.2.weight", "layers.2.bias"], "layers.0.bias", True, 2)),
    "delay_middle_static": (delay, (["layers.1.weight"], "layers.0.weight", True, 1, {"static_graph": True})),
    "delay_all": (delay_all, ()),
    "frozen_reference": (frozen_reference, ()),
    "delay_half_given": (delay_half_given, ()),
    "delay_everything": (delay_everything, ()),
    "mesh": (mesh, ((None,),)),
    "mesh_2d": (mesh, ((1, None),)),
    "mesh_sliced": (mesh, ((1, None), True)),
    "mesh_and_group": (mesh_and_group, ()),
}


def _args(args, world):
    """A mesh shape's None is the world size."""
    return tuple(tuple(world if d is None else d for d in a) if isinstance(a, tuple) else a for a in args)


def api_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    results = {name: side_by_side(CASES[name][0], rank, world, *_args(CASES[name][1], world))
               for name in case_names}
    torch.save(results, os.path.join(outdir, f"api_rank{rank}.pt"))
    dist.destroy_process_group()
