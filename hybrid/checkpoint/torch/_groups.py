"""The param groups a torch load restores: the saved hyperparameters of the group holding the same
parameters, checked against the receiving optimizer (its slots, AMSGrad's ``max_nu``). Shared by
the load of a plain, DDP or ZeRO model (``_load.py``) and of a ZeRO3 one (``_zero3.py``)."""

from __future__ import annotations

import warnings

from hybrid.checkpoint._manifest import CheckpointError
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint.torch._state import _inner, expected_slots, param_names_by_group

_NOT_HYPERPARAMETERS = ("params", "param_names", "not_saved")


def hyperparameters_of(group: dict) -> dict:
    """A saved param group's hyperparameters: every key but the parameters and what was not saved."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def restored_groups(ckpt: CheckpointReader, optimizer, group_names: list[list[str]]) -> list[dict]:
    """The receiving optimizer's groups with the saved hyperparameters of the group holding the
    same parameters (torch restores every key but ``params``)."""
    own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved = ckpt.manifest.optimizer.hyperparameters.get("param_groups") or []
    if not saved:
        return own
    if not all("param_names" in g for g in saved):
        warnings.warn(f"{ckpt.path}: saved by an older hybrid, without its param groups' parameter names: the "
                      f"optimizer keeps its own hyperparameters", stacklevel=3)
        return own
    by_names = {frozenset(g["param_names"]): g for g in saved}
    out = []
    for i, names in enumerate(group_names):
        g = by_names.get(frozenset(names))
        if g is None:
            raise CheckpointError(
                f"{ckpt.path}: the optimizer's param group {i} holds {names}, which is no saved group "
                f"(the checkpoint's groups hold {[s['param_names'] for s in saved]}): build the optimizer with "
                f"the saved groups, or load with hyperparameters='optimizer' to keep its own")
        # JSON made tuples lists: give back torch's types where the optimizer has a tuple (betas).
        restored = {k: (tuple(v) if isinstance(own[i].get(k), tuple) else v) for k, v in hyperparameters_of(g).items()}
        out.append({**own[i], **restored})
    return out


def saved_groups(ckpt: CheckpointReader, optimizer, name_of: dict[int, str], hyperparameters: str):
    """``(the checkpoint's OptimizerInfo, the hyperparameters each param group gets)``, once the
    saved state is known to fit ``optimizer`` (its slots, AMSGrad's ``max_nu``)."""
    info = ckpt.manifest.optimizer
    if info is None:
        raise CheckpointError(f"{ckpt.path}: holds no optimizer state (saved without an optimizer)")
    group_names = param_names_by_group(optimizer, name_of)
    groups = (restored_groups(ckpt, optimizer, group_names) if hyperparameters == "checkpoint"
              else [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    want = expected_slots(optimizer, groups)
    if set(info.slots) != set(want):
        raise CheckpointError(f"{ckpt.path}: holds {info.name} state {list(info.slots)}, but "
                              f"{type(_inner(optimizer)).__name__} keeps {list(want)}")
    for group, names in zip(groups, group_names):
        if group.get("amsgrad"):
            lacking = [n for n in names if info.has_state(n) and not info.holds("max_nu", n)]
            if lacking:
                raise CheckpointError(f"{ckpt.path}: parameters {lacking} are in an AMSGrad group, but were saved "
                                      f"without AMSGrad's max_exp_avg_sq")
    return info, groups
