"""Worker processes for tests/torch/test_ddp_logging.py: ``_get_ddp_logging_data()`` read after
construction and after every step, under torch's DDP and ours in the same gloo processes."""

from __future__ import annotations

import io
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from _workers import MLP, Unused, _data, _init, _loss, side_by_side

STEPS = 5
CAP_MB = 0.0005  # 524 bytes: a few buckets even for these small models


def _model(name, rank):
    torch.manual_seed(0)
    model = {"mlp": MLP, "unused": Unused}[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)
    return model


def _step(ddp, opt, rank, step, use_extra=None):
    """One step; ``use_extra`` (Unused only): whether ``sometimes`` takes part (None: MLP)."""
    x, y = _data(rank, step, "mlp")
    out = ddp(x) if use_extra is None else ddp(x, use_extra=use_extra)
    _loss(out, y).backward()
    opt.step()
    opt.zero_grad()


def training(cls, rank, world, model, kwargs, *, steps=STEPS, hook=None, extra=lambda rank, step: rank == 0,
             no_sync_steps=(), sample_rate=None):
    """The logging data after construction (and a hook's registration), then after each step."""
    ddp = cls(_model(model, rank), **kwargs)
    logs = [ddp._get_ddp_logging_data()]
    if hook == "ALLREDUCE":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    if sample_rate is not None:
        ddp._set_ddp_runtime_logging_sample_rate(sample_rate)
    logs.append(ddp._get_ddp_logging_data())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        use_extra = None if model == "mlp" else extra(rank, step)
        if step in no_sync_steps:
            with ddp.no_sync():
                x, y = _data(rank, step, "mlp")
                _loss(ddp(x) if use_extra is None else ddp(x, use_extra=use_extra), y).backward()
        else:
            _step(ddp, opt, rank, step, use_extra)
        logs.append(ddp._get_ddp_logging_data())
    return logs


def joined(cls, rank, world):
    """Uneven inputs: rank r takes STEPS + r steps inside ``join()``."""
    ddp = cls(_model("mlp", rank), bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    logs = [ddp._get_ddp_logging_data()]
    with ddp.join():
        logs.append(ddp._get_ddp_logging_data())
        for step in range(STEPS + rank):
            _step(ddp, opt, rank, step)
            logs.append(ddp._get_ddp_logging_data())
    logs.append(ddp._get_ddp_logging_data())
    return logs


def pickled(cls, rank, world):
    """torch.save / torch.load after two steps: the copy logs afresh (torch rebuilds its logger)."""
    ddp = cls(_model("mlp", rank), bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(2):
        _step(ddp, opt, rank, step)
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    opt = torch.optim.SGD(copy.parameters(), lr=0.05)
    logs = [ddp._get_ddp_logging_data(), copy._get_ddp_logging_data()]
    for step in range(3):
        _step(copy, opt, rank, 2 + step)
        logs.append(copy._get_ddp_logging_data())
    return logs


def _failing(ddp, action):
    """The error ``action()`` raises, and the logging data after it."""
    try:
        action()
    except (RuntimeError, TypeError, ValueError) as e:
        return {"error": str(e), "log": ddp._get_ddp_logging_data()}
    raise AssertionError("expected an error")


def static_late(cls, rank, world):
    """torch's test_static_graph_api_cpu: ``_set_static_graph()`` after one iteration."""
    ddp = cls(_model("mlp", rank))
    _step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), rank, 0)
    return _failing(ddp, ddp._set_static_graph)


def hook_twice(cls, rank, world):
    """A second comm hook: torch logs its name, then the once-only error."""
    ddp = cls(_model("mlp", rank))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return _failing(ddp, lambda: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS))


def hook_not_callable(cls, rank, world):
    ddp = cls(_model("mlp", rank))
    return _failing(ddp, lambda: ddp.register_comm_hook({}, {}))


def sample_rate_zero(cls, rank, world):
    ddp = cls(_model("mlp", rank))
    return _failing(ddp, lambda: ddp._set_ddp_runtime_logging_sample_rate(0))


def unfinished_reduction(cls, rank, world):
    """An unused parameter without find_unused_parameters: the second forward raises."""
    ddp = cls(_model("unused", rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    _step(ddp, opt, rank, 0, use_extra=False)
    return _failing(ddp, lambda: _step(ddp, opt, rank, 1, use_extra=False))


CASES = {
    # First in its process, as torch logs can_set_static_graph once per process (and not after
    # a DDP was destroyed): the unused set changes at the third step.
    "graph_changes": (training, ("unused", {"find_unused_parameters": True}),
                      {"extra": lambda rank, step: step >= 2}),
    "defaults": (training, ("mlp", {})),
    "find_unused": (training, ("unused", {"find_unused_parameters": True, "bucket_cap_mb": CAP_MB})),
    "static_graph": (training, ("unused", {"static_graph": True, "bucket_cap_mb": CAP_MB})),
    "static_graph_view": (training, ("unused", {"static_graph": True, "gradient_as_bucket_view": True,
                                                "bucket_cap_mb": CAP_MB}), {"extra": lambda rank, step: False}),
    "negative_cap": (training, ("mlp", {"bucket_cap_mb": -1}), {"steps": 2}),
    "cap_list": (training, ("mlp", {"bucket_cap_mb_list": [CAP_MB, 2 * CAP_MB]}), {"steps": 3}),
    "view": (training, ("mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": CAP_MB})),
    "comm_hook": (training, ("mlp", {"bucket_cap_mb": CAP_MB}), {"hook": default_hooks.allreduce_hook}),
    "builtin_hook": (training, ("mlp", {"bucket_cap_mb": CAP_MB}), {"hook": "ALLREDUCE"}),
    "no_sync": (training, ("mlp", {"bucket_cap_mb": CAP_MB}), {"no_sync_steps": (1, 2)}),
    # The same parameters unused on every rank, as the flag requires: a bucket of them is skipped.
    "skip_unused": (training, ("unused", {"find_unused_parameters": True, "skip_all_reduce_unused_params": True,
                                          "bucket_cap_mb": CAP_MB}), {"extra": lambda rank, step: False}),
    # Sampled at iterations 1 to 10, then every second one.
    "sample_rate": (training, ("mlp", {}), {"steps": 14, "sample_rate": 2}),
    "join": (joined, ()),
    "pickled": (pickled, ()),
}
ERROR_CASES = {"static_late": static_late, "hook_twice": hook_twice, "hook_not_callable": hook_not_callable,
               "sample_rate_zero": sample_rate_zero, "unfinished_reduction": unfinished_reduction}


def _case(name):
    if name in ERROR_CASES:
        return ERROR_CASES[name], ()
    fn, args, *kwargs = CASES[name]
    kwargs = kwargs[0] if kwargs else {}
    return lambda cls, rank, world: fn(cls, rank, world, *args, **kwargs), ()


def logging_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    # torch's logger reads these at construction (default "N/A"); set, so that they are compared.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results = {}
    for name in case_names:
        fn, args = _case(name)
        results[name] = side_by_side(fn, rank, world, *args)
    torch.save(results, os.path.join(outdir, f"logging_rank{rank}.pt"))
    dist.destroy_process_group()
