"""Writing a checkpoint (hybrid's, or any format hybrid reads, under torch's names) as a torch DCP
directory that torch's own ``dcp.load`` and ``set_state_dict`` read into an FSDP2 model.

The state dict written is the one ``get_state_dict(model, optimizer)`` gives, whole tensors under
``{"model": ..., "optim": ...}`` (torch's recipe; other keys with ``model_key`` / ``optim_key``),
written by torch's ``dcp.save`` in this process. A resuming FSDP2 run does what it does with its
own checkpoints:

.. code-block:: python

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)        # each rank reads its shards of the whole tensors
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

The param groups are complete for this torch's optimizer class (its defaults, then the saved
values), because ``dcp.load`` wants every key the receiving optimizer's groups have. The
training step is written as a top-level ``step`` (``dcp.load`` loads only the keys asked for).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hybrid.checkpoint._manifest import CheckpointError, OptimizerInfo
from hybrid.checkpoint.torch._state import TORCH_KEY_OF_SLOT

_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def _tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A stored array as the tensor of its logical ``dtype`` (bits viewed: bfloat16, float8, ...)."""
    from hybrid.checkpoint.torch._dtypes import from_numpy
    return from_numpy(a, getattr(torch, dtype), dtype)


def torch_param_groups(info: OptimizerInfo, names: list[str], given=None, *, where: str) -> list[dict]:
    """The param groups to write: ``given`` (torch's group dicts, ``params`` or ``param_names``
    by name) or the checkpoint's, each completed with the optimizer class's defaults."""
    cls = _CLASSES.get(info.name)
    if cls is None:
        raise CheckpointError(f"{where}: holds {info.name!r} state; torch DCP checkpoints are written for "
                              f"{sorted(_CLASSES)}")
    groups = list(given) if given is not None else list(info.hyperparameters.get("param_groups") or ())
    if not groups:
        raise CheckpointError(f"{where}: records no torch param groups (a JAX save without hyperparameters="
                              f"{{'param_groups': [...]}}?): pass param_groups= (torch's group dicts, parameters "
                              f"by name) so the resuming optimizer gets its hyperparameters")
    defaults = dict(cls([torch.zeros(1, requires_grad=True)]).defaults)
    out, placed = [], []
    for i, g in enumerate(groups):
        if g.get("not_saved"):
            raise CheckpointError(f"{where}: param group {i}'s {g['not_saved']} were not saved (not JSON: a tensor "
                                  f"lr?): pass param_groups= with their values")
        group_names = list(g.get("param_names", g.get("params", names if len(groups) == 1 else ())))
        hyper = {k: (tuple(v) if isinstance(defaults.get(k), tuple) else v) for k, v in g.items()
                 if k not in ("params", "param_names", "not_saved")}
        out.append({**defaults, **hyper, "params": group_names})
        placed += group_names
    if sorted(placed) != sorted(names):
        raise CheckpointError(f"{where}: the param groups hold {sorted(placed)}, the checkpoint's parameters are "
                              f"{sorted(names)}: each parameter in exactly one group")
    return out


def dcp_state_dict(ckpt, *, model_key: str | None = None, optim_key: str | None = None, param_groups=None) -> dict:
    """The state dict a DCP write saves (whole tensors) from the opened checkpoint ``ckpt``:
    ``{model_key: model_sd, optim_key: optim_sd, "step": step}`` as ``get_state_dict`` gives
    them, the LR scheduler's state and the entries the checkpoint carries (a torchtitan run's
    ``dataloader``, ``train_state``) where they were. Everything is checked first.

    Without ``model_key`` / ``optim_key``, a checkpoint that came from DCP is laid out as it was
    (torchtitan's: the model's entries at the top level, the optimizer flattened under
    ``optimizer``, the scheduler under ``lr_scheduler``), so the run that wrote it loads it back
    with its own ``dcp.load``; any other as torch's recipe, ``{"model":, "optim":}``."""
    m, where = ckpt.manifest, str(ckpt.path)
    was = m.metadata.get("dcp_layout") or {} if model_key is None and optim_key is None else {}
    model_key = model_key if model_key is not None else was.get("model_key", "model")
    optim_key = optim_key if optim_key is not None else (was.get("optim_key") or "optim")
    names = [s.name for s in m.plan.specs]
    info = m.optimizer
    groups = torch_param_groups(info, names, param_groups, where=where) if info is not None else None
    ckpt.verify()
    dtypes = {s.name: s.dtype for s in m.plan.specs}
    model = {n: _tensor(a, dtypes[n]) for n, a in ckpt.tensors("params").items()}
    for n, a in ckpt.buffers().items():
        model[n] = _tensor(a, m.buffers[n]["dtype"])
    out: dict = {"step": torch.tensor(m.step)}
    _place(out, model_key, model)
    if info is not None:
        slots = {s: ckpt.tensors(s) for s in info.slots}
        state = {}
        for n in names:
            if not info.has_state(n):
                continue
            st = {} if info.name == "sgd" else {"step": torch.tensor(float(info.count_of(n)))}
            st.update({TORCH_KEY_OF_SLOT[s]: _tensor(slots[s][n], dtypes[n]) for s in info.slots if info.holds(s, n)})
            state[n] = st
        _place(out, optim_key, _flat_optimizer(state, groups) if was.get("optim_flat") else
               {"state": state, "param_groups": groups})
    _add_run_state(out, m.run_state, was.get("scheduler") or ["lr_scheduler"])
    return out


def _place(out: dict, key: str, value: dict) -> None:
    """``out[key] = value`` for a dotted ``key`` (nested), or ``value``'s entries at the top for ``""``."""
    node = out
    for part in key.split(".") if key else ():
        node = node.setdefault(part, {})
    node.update(value)


def _flat_optimizer(state: dict, groups: list[dict]) -> dict:
    """The optimizer state dict as ``flatten_optimizer_state_dict=True`` gives it (torchtitan's):
    ``state.NAME.KEY`` and ``param_groups.NAME.KEY``."""
    flat = {f"state.{n}.{k}": v for n, st in state.items() for k, v in st.items()}
    for g in groups:
        flat.update({f"param_groups.{n}.{k}": v for n in g["params"] for k, v in g.items() if k != "params"})
    return flat


def _add_run_state(out: dict, run_state: dict, scheduler_path: list) -> None:
    """The LR scheduler's state (at ``scheduler_path``) and the carried entries, where they were."""
    from hybrid.checkpoint._other_state import Tensor, carried_entries, nest

    def as_torch(v):
        if isinstance(v, Tensor):
            return _tensor(v.array, v.dtype).reshape(v.array.shape)
        if isinstance(v, (list, tuple)):
            return type(v)(as_torch(x) for x in v)
        if isinstance(v, dict):
            return {k: as_torch(x) for k, x in v.items()}
        return v

    if "scheduler" in run_state:
        nest([(tuple(scheduler_path), dict(run_state["scheduler"]))], out)
    nest([(path, as_torch(v)) for path, v in carried_entries(run_state)], out)


def save_here(state: dict, path: str | os.PathLike) -> None:
    """torch's ``dcp.save`` of whole tensors from this process alone (no collectives, whatever
    process group exists: the warning that it assumes so is the intent here)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(path)), no_dist=True)
