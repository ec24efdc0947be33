"""A ZeRO3 model's whole-tensor state dicts: gathered to every rank or to rank 0 only, and loaded
straight into each rank's slices; and the ``external_params=`` declaration it checks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from hybrid.torch._collectives import naming


def full_state_dict(model, *, prefix: str, to_rank0: bool) -> dict[str, Any]:
    """DDP's state dict of ``model`` (keys ``module.*``), each bucket gathered whole to every rank,
    or (``to_rank0``) to rank 0 only, the others getting an empty dict. A collective."""
    out = nn.Module.state_dict(model, prefix=prefix, keep_vars=True)
    keep = not to_rank0 or model.rank == 0
    values: dict[int, torch.Tensor] = {}
    for b, bucket in enumerate(model.bucket_plan.buckets):
        full = _bucket_to_rank0(model, b) if to_rank0 else model._buckets.exact(b, "state_dict()")
        if keep:
            for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
                values[id(model._params[m])] = full[o:o + n].view(model._params[m].shape).clone()
        del full
    if not keep:
        return type(out)()
    return type(out)((k, values[id(v)] if id(v) in values else v.detach()) for k, v in out.items())


def _bucket_to_rank0(model, b: int) -> torch.Tensor | None:
    """Bucket ``b`` whole on rank 0 (in the slices' dtype), None elsewhere: every rank sends its slice."""
    mine = model._buckets.slices[b]
    if model.world_size == 1:
        return mine
    dst = dist.get_global_rank(model.process_group, 0) if model.process_group is not None else 0
    parts = [torch.empty_like(mine) for _ in range(model.world_size)] if model.rank == 0 else None
    with naming(f"ZeRO3 full_state_dict(): the gather of bucket {b}'s slices to rank 0"):
        dist.gather(mine, parts, dst=dst, group=model.process_group)
    return torch.cat(parts) if parts is not None else None


@torch.no_grad()
def load_state_dict(model, state_dict: Mapping[str, Any], *, strict: bool) -> _IncompatibleKeys:
    """torch's ``load_state_dict`` into ``model``'s slices and buffers: its key and shape checks
    first (nothing changes if they fail), then each rank copies its own elements. No collective."""
    own = nn.Module.state_dict(model, keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    errors = [f"size mismatch for {k}: copying a param with shape {tuple(v.shape)} from checkpoint, the shape in "
              f"current model is {tuple(own[k].shape)}." for k, v in state_dict.items()
              if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if strict:
        errors = ([f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}."] if unexpected else []) \
            + ([f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}."] if missing else []) + errors
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t" + "\n\t".join(errors))
    sharded = {id(p) for p in model._params}
    if not model._schedule.pinned:
        model._buckets.free_all()  # a bucket left gathered would hold the old values
    model._buckets.load({i: state_dict[f"module.{n}"] for i, n in enumerate(model._names)
                         if f"module.{n}" in state_dict})
    for k, t in own.items():
        if id(t) not in sharded and k in state_dict:
            t.copy_(state_dict[k])
    return _IncompatibleKeys(missing, unexpected)


def declared_external(module: nn.Module, external_params: Mapping[nn.Module, Iterable[nn.Parameter]] | None,
                      index_of: dict[int, int]) -> dict[nn.Module, tuple[int, ...]]:
    """``external_params`` checked: ``{module of the model: spec indices of sharded parameters}``."""
    if external_params is None:
        return {}
    if not isinstance(external_params, Mapping):
        raise TypeError(f"external_params must map modules to the parameters their forward reads besides their "
                        f"own, got {type(external_params).__name__}")
    names = {id(m): n for n, m in module.named_modules()}
    param_names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for m, params in external_params.items():
        if not isinstance(m, nn.Module) or id(m) not in names:
            raise ValueError(f"external_params: {type(m).__name__} {m!r:.60} is not a module of the wrapped model")
        where = repr(names[id(m)] or "the root module")
        indices = []
        for p in params:
            if id(p) not in index_of:
                what = (f"{param_names[id(p)]!r}, which is not sharded (it needs no gradient)"
                        if id(p) in param_names else f"a tensor of shape {tuple(p.shape)} that is no parameter "
                        f"of the wrapped model")
                raise ValueError(f"external_params[{where}]: {what}")
            indices.append(index_of[id(p)])
        out[m] = tuple(indices)
    return out
