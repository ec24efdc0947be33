"""What a torch optimizer holds, in the checkpoint's terms: which parameters have state on this
rank, torch's state keys as framework-neutral slots, and the step count they agree on.

ZeroRedundancyOptimizer (hybrid's or torch's) holds whole tensors of its own share, ZeRO2 hands
out every parameter's whole state through its ``state_dict()`` (a collective), a plain optimizer
holds everything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from hybrid.core import TensorSpec, canonical_dtype
from hybrid.checkpoint._manifest import CheckpointError, OptimizerInfo


# torch's state keys -> the checkpoint's framework-neutral slot names (optax's field names).
# AMSGrad's max_exp_avg_sq is "max_nu": the running maximum of the raw second moment, torch's
# meaning (optax's amsgrad keeps the maximum of the bias-corrected one: another algorithm).
SLOT_OF_TORCH_KEY = {"exp_avg": "mu", "exp_avg_sq": "nu", "momentum_buffer": "trace", "max_exp_avg_sq": "max_nu"}
TORCH_KEY_OF_SLOT = {v: k for k, v in SLOT_OF_TORCH_KEY.items()}
_NAME_OF_CLASS = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd"}


def _unwrap(module: nn.Module) -> nn.Module:
    # hybrid's and torch's DDP both keep the user's model in .module; names are the model's own.
    return module.module if hasattr(module, "module") and hasattr(module, "process_group") else module


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a checkpoint holds, in DDP's registration order, named as in the bare model."""
    from hybrid.torch.ddp._parts import _reduced_parameters
    return _reduced_parameters(_unwrap(module))


def ddp_buckets(module: nn.Module) -> dict | None:
    """What a resume needs to reduce in the saving DDP's buckets: its rebuilt plan and layout
    settings, for ``run_state``; None unless ``module`` is hybrid's DDP after its rebuild, or
    carries the record of the checkpoint it was loaded from (``_carried``: until it rebuilds)."""
    from hybrid.checkpoint.torch._carried import carried_ddp_buckets
    from hybrid.torch import DistributedDataParallel
    carried = carried_ddp_buckets(module)
    if carried is not None:
        return carried
    if not isinstance(module, DistributedDataParallel) or not getattr(module, "_has_rebuilt", False):
        return None
    return {"plan": module.bucket_plan.to_json(), "settings": dict(module._layout_settings)}


def _specs(named) -> list[TensorSpec]:
    # Devices are left out: a checkpoint is the same whichever GPU each rank saved it from.
    return [TensorSpec(n, tuple(p.shape), canonical_dtype(p.dtype)) for n, p in named]


def _numpy(t: torch.Tensor) -> np.ndarray:
    from hybrid.checkpoint.torch._dtypes import to_numpy
    return to_numpy(t)


def _torch(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    from hybrid.checkpoint.torch._dtypes import from_numpy
    return from_numpy(a, like.dtype).to(device=like.device).reshape(like.shape)


# -- which optimizer holds which state --------------------------------------------------------------

def _inner(optimizer):
    """The torch.optim optimizer that really steps (ZeRO's local one, or the optimizer itself)."""
    return getattr(optimizer, "optim", optimizer)


def _is_zero2(optimizer) -> bool:
    from hybrid.torch import ZeRO2
    return isinstance(optimizer, ZeRO2)


def _is_zero3(obj) -> bool:
    """A ZeRO3 model or its optimizer (they save and load their slices as they are)."""
    from hybrid.torch import ZeRO3, ZeRO3Optimizer
    return isinstance(obj, (ZeRO3, ZeRO3Optimizer))


def _is_zero1(optimizer) -> bool:
    from hybrid.torch import ZeroRedundancyOptimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    return isinstance(optimizer, (ZeroRedundancyOptimizer, TorchZero))


def kept_states(optimizer) -> set[int] | None:
    """The ids of the parameters whose state ``optimizer.load_state_dict`` keeps (None: every
    one): a ZeRO-1 rank keeps that of the parameters it owns (once its overlap hook has assigned
    buckets, which happens later: there, every one)."""
    if _is_zero1(optimizer) and not getattr(optimizer, "_overlap_with_ddp", False):
        return {id(p) for p, r in optimizer._param_to_rank.items() if r == optimizer.rank}
    return None


def _params_in_state_order(optimizer) -> list[torch.Tensor]:
    """The parameter behind each index of ``optimizer.state_dict()`` (torch's numbering)."""
    if _is_zero2(optimizer) or _is_zero3(optimizer):
        return [optimizer._params[i] for i in optimizer._torch_order]
    return [p for g in optimizer.param_groups for p in g["params"]]


def _group_sizes(optimizer) -> list[int]:
    if _is_zero2(optimizer) or _is_zero3(optimizer):
        return [optimizer._group_of.count(g) for g in range(len(optimizer.param_groups))]
    return [len(g["params"]) for g in optimizer.param_groups]


def _local_states(optimizer) -> tuple[dict[int, dict[str, Any]], bool]:
    """``({id(param): torch state}, complete)``: what this rank holds, and whether it is all of it."""
    if _is_zero2(optimizer):  # a collective: every rank gets every parameter's whole state
        params = _params_in_state_order(optimizer)
        return {id(params[i]): st for i, st in optimizer.state_dict()["state"].items()}, True
    if _is_zero1(optimizer):
        if getattr(optimizer, "_overlap_with_ddp", False):
            params = optimizer._params
            return {id(params[i]): st for i, st in optimizer._overlap_local_state()["state"].items()}, False
        return {id(p): st for p, st in optimizer.optim.state.items()}, optimizer.world_size == 1
    return {id(p): st for p, st in optimizer.state.items()}, True


def expected_slots(optimizer, groups=None) -> tuple[str, ...]:
    """The slots ``optimizer`` keeps once it has stepped (known before it has), for its own
    param groups or for ``groups`` (hyperparameter dicts about to replace them)."""
    inner = _inner(optimizer)
    name = type(inner).__name__
    groups = groups if groups is not None else (inner.param_groups or [inner.defaults])
    if name in ("Adam", "AdamW"):
        return ("mu", "nu", "max_nu") if any(g.get("amsgrad") for g in groups) else ("mu", "nu")
    if name == "SGD":
        return ("trace",) if any(g.get("momentum", 0) for g in groups) else ()
    raise CheckpointError(f"checkpoints hold Adam, AdamW and SGD state; {name} is not supported yet")


def param_names_by_group(optimizer, name_of: dict[int, str]) -> list[list[str]]:
    """The names of each param group's parameters, in torch's state-dict order."""
    order, out, start = _params_in_state_order(optimizer), [], 0
    for size in _group_sizes(optimizer):
        out.append([name_of[id(p)] for p in order[start:start + size]])
        start += size
    return out


def _hyperparameters(optimizer, name_of: dict[int, str]) -> dict[str, Any]:
    """Every param group's hyperparameters (what torch's ``load_state_dict`` restores) and the
    names of its parameters, so a load can match groups by name."""
    def jsonable(v):
        return isinstance(v, (int, float, bool, str)) or v is None or (
            isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))
    names = param_names_by_group(optimizer, name_of)
    groups = []
    for group, group_names in zip(optimizer.param_groups, names):
        kept = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params" and jsonable(v)}
        # A value JSON cannot hold (a tensor lr): the receiving optimizer's stays; say which.
        not_saved = sorted(k for k, v in group.items() if k != "params" and not jsonable(v))
        groups.append({**kept, **({"not_saved": not_saved} if not_saved else {}), "param_names": group_names})
    return {"param_groups": groups}


def _slots_and_count(named, states: dict[int, dict[str, Any]]) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, int]]:
    """This rank's slot arrays by name, and the step count of every parameter that has one."""
    slots: dict[str, dict[str, np.ndarray]] = {}
    counts: dict[str, int] = {}
    for name, p in named:
        st = states.get(id(p))
        if not st:
            continue
        for key, value in st.items():
            if key == "step":
                counts[name] = int(value.item() if torch.is_tensor(value) else value)
            elif torch.is_tensor(value) and value.shape == p.shape:
                if value.dtype != p.dtype:  # a slot is cut by its parameter's bucket: refused before any write
                    raise CheckpointError(f"the optimizer's {key!r} of {name!r} is {value.dtype}, its parameter "
                                          f"{p.dtype}: hybrid checkpoints hold state in its parameter's dtype")
                slots.setdefault(SLOT_OF_TORCH_KEY.get(key, key), {})[name] = _numpy(value)
    return slots, counts


def optimizer_info(name: str, expected: tuple[str, ...], hyperparameters: dict, names: list[str],
                   counts: dict[str, int], holders: dict[str, set[str]], *, sgd_count: int) -> OptimizerInfo:
    """The manifest's account of torch's per-parameter state: which parameters have state, their
    step counts, which slots each holds (``holders[slot]``: the names that hold it)."""
    unknown = sorted(set(holders) - set(expected))
    if unknown:
        raise CheckpointError(f"the optimizer holds state {unknown} beyond its known slots {list(expected)}")
    with_state = set(counts).union(*holders.values()) if holders else set(counts)
    if not counts and with_state:
        # SGD counts no steps (nor does optax's trace); its buffers exist once it has stepped.
        counts = {n: int(sgd_count) for n in with_state}
    distinct = set(counts.values())
    count = max(distinct) if distinct else 0
    slot_params = {s: tuple(n for n in names if n in holders.get(s, ())) for s in expected
                   if set(holders.get(s, ())) != with_state}
    return OptimizerInfo(name, expected, count, hyperparameters,
                         without_state=tuple(n for n in names if n not in with_state),
                         counts={n: counts[n] for n in names if n in counts} if len(distinct) > 1 else {},
                         slot_params=slot_params)


def named_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's persistent buffers (what ``state_dict()`` holds besides parameters), named as
    in the bare model: BatchNorm's running statistics and ``num_batches_tracked``, ...; outside
    ZeRO3, also the parameters DDP does not reduce (frozen or ignored), which are replicated."""
    out, seen = [], set()
    for prefix, mod in _unwrap(module).named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{name}" if prefix else name, buf))
    if not _is_zero3(module):
        # Parameters DDP does not reduce (frozen: an int or float8 parameter, a frozen embedding;
        # DDP's ignored ones) are in torch's state_dict too: kept, like buffers, from rank 0's copy.
        reduced = {id(p) for _, p in named_parameters(module)}
        for name, p in _unwrap(module).named_parameters():
            if id(p) not in reduced and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p.detach()))
    return out


def _fill_slots(params: dict[str, np.ndarray], slots, info) -> dict[str, dict[str, np.ndarray]]:
    """Every expected slot for every parameter (``params``: name -> stored array): zeros where no
    state exists (the manifest says which, and a load restores none there)."""
    if info is None:
        return {}
    return {s: {n: slots.get(s, {}).get(n, np.zeros_like(p)) for n, p in params.items()}
            for s in info.slots}
