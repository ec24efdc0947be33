"""Worker processes for tests/torch/test_ddp_habits.py: what torch users do with a DDP model
(pickle it, accumulate with no_sync, set a static graph late, built-in hooks), torch's class and
ours one after the other in the same gloo processes, results saved per rank."""

from __future__ import annotations

import copy
import io
import os
import pickle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _workers import MLP, ConvBN, Unused, _data, _init, _loss, side_by_side  # noqa: F401 - Unused for the test


def _model(name, rank):
    torch.manual_seed(0)
    model = {"mlp": MLP, "unused": Unused, "conv_bn": ConvBN, "wide": lambda: MLP(width=64, depth=5)}[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)  # different per rank: DDP's initial broadcast must fix it
    return model


def _step(ddp, opt, rank, step, name, extra=None):
    kw = {"use_extra": rank == 0 if extra is None else extra} if name == "unused" else {}
    x, y = _data(rank, step, name)
    _loss(ddp(x, **kw), y).backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in ddp.module.parameters()]
    opt.step()
    opt.zero_grad()
    return grads


def _torch_save_load(ddp):
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda d: pickle.loads(pickle.dumps(d)),
          "torch_save": _torch_save_load}


def pickling(cls, rank, world, how, model_name, kwargs):
    """Two steps, copy the wrapped model, two more steps on the copy (a fresh optimizer)."""
    ddp = cls(_model(model_name, rank), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        _step(ddp, opt, rank, step, model_name)
    # "rewrap": a new DDP around a copy of the module, the reference where torch's own copy fails.
    twin = cls(copy.deepcopy(ddp.module), **kwargs) if how == "rewrap" else COPIES[how](ddp)
    assert twin.module is not ddp.module
    opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    grads = [_step(twin, opt, rank, step, model_name) for step in range(2, 5)]
    return {"params": [p.detach().clone() for p in twin.module.parameters()], "grads": grads,
            "original": [p.detach().clone() for p in ddp.module.parameters()]}


def pickling_subgroup(cls, rank, world):
    """torch refuses to pickle a DDP over a process group other than the default one."""
    group = dist.new_group(list(range(world)))
    ddp = cls(MLP(), process_group=group)
    copy.deepcopy(ddp)


def no_sync_unused(cls, rank, world, kwargs):
    """find_unused_parameters with accumulation: ``sometimes`` is used by rank 0 inside no_sync()
    only, by no rank in the synchronizing micro-batch; ``never`` by no rank at all."""
    ddp = cls(_model("unused", rank), find_unused_parameters=True, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for step in range(3):
        with ddp.no_sync():
            x, y = _data(rank, 10 * step, "unused")
            _loss(ddp(x, use_extra=rank == 0), y).backward()
        grads.append(_step(ddp, opt, rank, 10 * step + 1, "unused", extra=False))
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "grads": grads}


def _train(ddp, rank, model_name, steps=4, extra=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    grads = [_step(ddp, opt, rank, step, model_name, extra) for step in range(steps)]
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "grads": grads}


def static_late(cls, rank, world, model_name, kwargs):
    """``_set_static_graph()`` right after construction, as Lightning-style trainers call it."""
    ddp = cls(_model(model_name, rank), **kwargs)
    ddp._set_static_graph()
    return _train(ddp, rank, model_name, extra=False)  # the same graph every step


def static_late_after_training(cls, rank, world):
    ddp = cls(_model("mlp", rank))
    _train(ddp, rank, "mlp", steps=1)
    ddp._set_static_graph()


def static_twice(cls, rank, world):
    cls(_model("mlp", rank), static_graph=True)._set_static_graph()


def builtin_hook(cls, rank, world, hook_type):
    ddp = cls(_model("wide", rank), bucket_cap_mb=0.01)
    ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook_type))
    return _train(ddp, rank, "wide")


def will_sync(cls, rank, world):
    """will_sync_module_buffers() along forwards with and without sync, and the buffers of a
    BatchNorm model trained with no_sync() accumulation and an eval forward between steps."""
    seen = [cls(_model("mlp", rank)).will_sync_module_buffers(),
            cls(_model("conv_bn", rank), broadcast_buffers=False).will_sync_module_buffers()]
    ddp = cls(_model("conv_bn", rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    seen.append(ddp.will_sync_module_buffers())
    for step in range(3):
        with ddp.no_sync():
            x, y = _data(rank, 10 * step, "conv_bn")
            _loss(ddp(x), y).backward()
        seen.append(ddp.will_sync_module_buffers())
        _step(ddp, opt, rank, 10 * step + 1, "conv_bn")
        seen.append(ddp.will_sync_module_buffers())
        with torch.no_grad():
            ddp(_data(rank, 10 * step + 2, "conv_bn")[0])
        seen.append(ddp.will_sync_module_buffers())
    return {"seen": seen, "buffers": [b.detach().clone() for b in ddp.module.buffers()],
            "params": [p.detach().clone() for p in ddp.module.parameters()]}


def skip_unused(cls, rank, world, kwargs):
    """skip_all_reduce_unused_params=True: the same parameters unused on every rank (torch's
    requirement), so the used map need not be all-reduced."""
    ddp = cls(_model("unused", rank), find_unused_parameters=True, skip_all_reduce_unused_params=True, **kwargs)
    return _train(ddp, rank, "unused", extra=False)


def join_unused(cls, rank, world, skip):
    """Uneven inputs (rank r takes 3 + r steps) under join(), the same parameters unused on every
    rank, small buckets: with ``skip``, two buckets are not all-reduced, by the joined ranks
    either. torch's joined ranks all-reduce every bucket, which the skipping ranks do not match:
    ours is compared with torch's run without skip (the same averages)."""
    if skip and cls is TorchDDP:
        return None
    ddp = cls(_model("unused", rank), find_unused_parameters=True, skip_all_reduce_unused_params=skip,
              bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with ddp.join():
        grads = [_step(ddp, opt, rank, step, "unused", extra=False) for step in range(3 + rank)]
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "grads": grads}


def logging_data(cls, rank, world, kwargs):
    ddp = cls(_model("wide", rank), **kwargs)
    before = ddp._get_ddp_logging_data()
    _train(ddp, rank, "wide", steps=2)
    return {"before": before, "after": ddp._get_ddp_logging_data()}


CASES = {
    **{f"pickle_{how}_{m}_{tag}": (pickling, (how, m, kw))
       for how in COPIES
       for m, tag, kw in (("mlp", "plain", {}), ("mlp", "static", {"static_graph": True}),
                          ("unused", "find_unused", {"find_unused_parameters": True}))},
    "pickle_rewrap_mlp_static": (pickling, ("rewrap", "mlp", {"static_graph": True})),
    "pickle_subgroup": (pickling_subgroup, ()),
    "no_sync_unused": (no_sync_unused, ({},)),
    "static_late_mlp": (static_late, ("mlp", {})),
    "static_late_unused": (static_late, ("unused", {})),
    "static_late_find_unused": (static_late, ("unused", {"find_unused_parameters": True})),
    "static_late_reference": (static_late, ("unused", {"static_graph": True})),
    "static_late_after_training": (static_late_after_training, ()),
    "static_twice": (static_twice, ()),
    "builtin_ALLREDUCE": (builtin_hook, ("ALLREDUCE",)),
    "builtin_FP16_COMPRESS": (builtin_hook, ("FP16_COMPRESS",)),
    "will_sync": (will_sync, ()),
    "skip_unused": (skip_unused, ({},)),
    "skip_unused_view": (skip_unused, ({"gradient_as_bucket_view": True},)),
    # Small buckets: two hold only unused parameters, so torch skips their all-reduce.
    "skip_unused_buckets": (skip_unused, ({"bucket_cap_mb": 0.0005},)),
    "skip_unused_buckets_view": (skip_unused, ({"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True},)),
    "join_unused": (join_unused, (False,)),
    "join_skip_unused": (join_unused, (True,)),
    "logging": (logging_data, ({"bucket_cap_mb": 0.004},)),
    "logging_defaults": (logging_data, ({},)),
    "no_sync_unused_view": (no_sync_unused, ({"gradient_as_bucket_view": True},)),
}


def habits_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    results = {name: side_by_side(CASES[name][0], rank, world, *CASES[name][1]) for name in case_names}
    torch.save(results, os.path.join(outdir, f"habits_rank{rank}.pt"))
    dist.destroy_process_group()
