"""Loading torch runs: parameters, buffers, optimizer state and hyperparameters, the LR scheduler,
as torch's own ``load_state_dict`` calls would restore them; or a checkpoint as torch's dicts.

A load reads files only (no communication): call it on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hybrid.checkpoint._formats import open_checkpoint
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.core import BucketPlan
from hybrid.checkpoint._manifest import DDP_PLAN_KEY, CheckpointError, OptimizerInfo
from hybrid.checkpoint.torch._groups import hyperparameters_of, saved_groups
from hybrid.checkpoint.torch._state import (
    TORCH_KEY_OF_SLOT, _group_sizes, _is_zero3, _params_in_state_order, _specs, _torch, _unwrap, kept_states,
    named_buffers, named_parameters)


def state_dicts(path: str | os.PathLike, *, format: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint as torch's two dicts: ``model.state_dict()`` (parameters and buffers by name),
    and the state dict of a plain optimizer over ``model.parameters()`` with the saved param groups
    (the format ``ZeroRedundancyOptimizer.consolidate_state_dict`` + ``state_dict()`` gives).

    >>> import torch, tempfile, os
    >>> from hybrid.checkpoint.torch import save
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, model, opt, step=1)
    >>> model_sd, opt_sd = state_dicts(d)
    >>> sorted(model_sd), sorted(opt_sd["state"][0])
    (['bias', 'weight'], ['momentum_buffer'])
    """
    ckpt = open_checkpoint(path, format=format)
    ckpt.verify()
    specs = ckpt.manifest.plan.specs
    likes = [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in specs]
    params = ckpt.tensors("params")
    model = {s.name: _torch(params[s.name], like) for s, like in zip(specs, likes)}
    for name, value in ckpt.buffers().items():
        model[name] = _torch(value, torch.empty(value.shape, dtype=getattr(torch, ckpt.manifest.buffers[name]["dtype"])))
    info = ckpt.manifest.optimizer
    if info is None:
        return model, {"state": {}, "param_groups": []}
    state = torch_states(ckpt, info, likes)
    saved = info.hyperparameters.get("param_groups") or [{}]
    index = {s.name: i for i, s in enumerate(specs)}
    if len(saved) == 1 or not all("param_names" in g for g in saved):
        if len(saved) != 1:
            raise CheckpointError(f"{ckpt.path}: saved with {len(saved)} parameter groups but without their "
                                  "parameters' names (an older hybrid); load with load() into your optimizer")
        groups = [{**hyperparameters_of(saved[0]), "params": list(range(len(specs)))}]
    else:
        groups = [{**hyperparameters_of(g), "params": [index[n] for n in g["param_names"]]} for g in saved]
    return model, {"state": state, "param_groups": groups}


def torch_states(ckpt: CheckpointReader, info: OptimizerInfo, likes: list[torch.Tensor],
                 names=None) -> dict[int, dict[str, Any]]:
    """torch's per-parameter state (checkpoint order) from the slots: nothing for a parameter the
    manifest says has no state, each its own step count, only the slots it holds. ``names``: only
    those parameters' (the others' state is not read)."""
    specs = ckpt.manifest.plan.specs
    if info.count == 0 and not info.counts:
        return {}  # never stepped: a fresh torch optimizer holds no state
    slots = {s: ckpt.tensors(s, names) for s in info.slots}
    state = {}
    for i, (spec, like) in enumerate(zip(specs, likes)):
        if not info.has_state(spec.name) or (names is not None and spec.name not in names):
            continue
        st: dict[str, Any] = {"step": torch.tensor(float(info.count_of(spec.name)))} if info.name != "sgd" else {}
        for slot in info.slots:
            if info.holds(slot, spec.name):
                st[TORCH_KEY_OF_SLOT.get(slot, slot)] = _torch(slots[slot][spec.name], like)
        state[i] = st
    return state


def load(path, module: nn.Module, optimizer=None, *, scheduler=None, hyperparameters: str = "checkpoint",
         buffers: bool = True, restore_buckets: bool = False, format: str | None = None, mapping=None) -> int:
    """Load a checkpoint (saved by either frontend, at any world size) into ``module``,
    ``optimizer`` and ``scheduler``, as torch's ``load_state_dict`` calls would; returns the saved step.

    Every file is checked (its size; an XXH3-128 checksum of its header, which holds an XXH3-128
    checksum of each chunk of its data, checked as the chunk is read; format 1-2 checkpoints: the
    whole file's SHA-256; the manifest it was written for) and every
    tensor and buffer matched to the model by name, shape and dtype before anything changes: a bad
    checkpoint raises :class:`~hybrid.checkpoint.CheckpointError` naming the file and leaves the
    model, optimizer and scheduler as they were. Call it on every rank (it reads files, it does
    not communicate). The user's run state comes back from :func:`hybrid.checkpoint.read_state`.

    Args:
      hyperparameters: ``"checkpoint"`` (torch's behaviour): each param group gets the saved
        hyperparameters (lr, betas, weight_decay, amsgrad, ``initial_lr``, ...) of the saved group
        with the same parameters (matched by name; a group whose parameters moved is an error).
        ``"optimizer"``: keep those the receiving optimizer was built with.
      buffers: restore the module's persistent buffers (BatchNorm statistics); False keeps the
        module's own (e.g. a checkpoint saved without them).
      restore_buckets: hybrid's, opt-in. ``module`` is a ``hybrid.torch.DistributedDataParallel``
        and takes the rebuilt bucket plan of the DDP that saved the checkpoint, so the first step
        after the resume reduces in the same buckets as the uninterrupted run: the resume is then
        bit for bit at any world size. By default (torch's behaviour) a fresh DDP reduces its first
        step in one bucket per dtype and rebuilds at its second; a ring all-reduce sums an element
        in an order that depends on its place in the bucket, so at 3 ranks and more that step is
        rounded differently (about 1e-7). Needs a checkpoint saved by hybrid's DDP after its
        rebuild, and a DDP built with the same bucket caps, ``find_unused_parameters`` and
        ``static_graph`` (each checked before anything changes).
      format: ``"hybrid"``, ``"dcp"`` (torch's distributed checkpoint, e.g. from FSDP2) or
        ``"orbax"`` to insist on one; default: recognised from the directory. ``path`` may also
        be a checkpoint opened by ``hybrid.checkpoint.open_checkpoint`` (for its options).
      mapping: a ``hybrid.core.ParamMapping`` (or ``ParamPairing``) for a checkpoint in a JAX
        tree's names and layouts (an orbax checkpoint of a flax model): each tensor is placed on
        the module's side through it; one it cannot place is a ``MappingError`` naming it.

    >>> import torch, tempfile, os
    >>> from hybrid.checkpoint.torch import save
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, model, opt, step=5, world_size=3)
    >>> other = torch.nn.Linear(3, 2); other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    >>> load(d, other, other_opt), other_opt.param_groups[0]["lr"]
    (5, 0.1)
    >>> torch.equal(other.weight, model.weight)
    True
    """
    module = getattr(module, "_orig_mod", module)  # torch.compile(model): the model it runs
    if hyperparameters not in ("checkpoint", "optimizer"):
        raise ValueError(f"load: hyperparameters={hyperparameters!r}; expected 'checkpoint' (restore the saved "
                         f"ones, as torch does) or 'optimizer' (keep the optimizer's own)")
    if restore_buckets and _is_zero3(module):
        raise TypeError("load(restore_buckets=True) restores hybrid.torch.DistributedDataParallel's buckets; "
                        "ZeRO3 plans its buckets once, from the module (nothing to restore)")
    ckpt = _open(path, module, format, mapping)
    if _is_zero3(module):  # each rank reads the elements of its own slices
        from hybrid.checkpoint.torch._zero3 import load_zero3
        return load_zero3(ckpt, module, optimizer, scheduler=scheduler, hyperparameters=hyperparameters,
                          buffers=buffers)
    named = named_parameters(module)
    what = type(_unwrap(module)).__name__
    ckpt.check_model(_specs(named), what=what)
    named_bufs = named_buffers(module) if buffers else []
    if named_bufs and not ckpt.manifest.buffers:
        raise CheckpointError(f"{ckpt.path}: holds no buffers, but {what} has {[n for n, _ in named_bufs]} (saved by "
                              f"an older hybrid, or from JAX without buffers=): load with buffers=False to keep "
                              f"the module's own")
    if buffers:
        ckpt.check_buffers({n: tuple(b.shape) for n, b in named_bufs}, what=what)
    if scheduler is not None:
        ckpt.scheduler_state()  # raises, naming the format read, where it holds none
    plan = saved_ddp_plan(ckpt, module) if restore_buckets else None
    ckpt.verify()
    params = ckpt.tensors("params")
    new_params = [_torch(params[n], p) for n, p in named]
    saved_buffers = ckpt.buffers() if buffers else {}
    new_buffers = [_torch(saved_buffers[n], b) for n, b in named_bufs]
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = _optimizer_state_dict(ckpt, named, optimizer, hyperparameters)
    # Nothing has changed so far; from here on the inputs are all checked.
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    with torch.no_grad():
        for (_, p), value in zip(named, new_params):
            p.copy_(value)
        for (_, b), value in zip(named_bufs, new_buffers):
            b.copy_(value)
    if scheduler is not None:
        scheduler.load_state_dict(ckpt.manifest.run_state["scheduler"])
    if plan is not None:
        module._restore_rebuilt_plan(plan)
    from hybrid.checkpoint.torch._carried import carry_ddp_buckets  # a load then a save: the same bytes
    carry_ddp_buckets(ckpt, module, _specs(named), restored=plan is not None)
    return ckpt.manifest.step


def _open(path, module, format, mapping) -> CheckpointReader:
    """The checkpoint at ``path`` (any format), under the module's names (through ``mapping``)."""
    if _is_zero3(module):
        names, shapes = list(module._names), {s.name: s.shape for s in module.bucket_plan.specs}
    else:
        named = named_parameters(module)
        names, shapes = [n for n, _ in named], {n: tuple(p.shape) for n, p in named}
    if mapping is None:
        ckpt = open_checkpoint(path, format=format, param_names=names)
        saved = {s.name for s in ckpt.manifest.plan.specs}
        if ckpt.manifest.framework == "jax" and ckpt.format != "hybrid" and saved != set(names):
            raise CheckpointError(f"{ckpt.path}: an {ckpt.format} checkpoint of a JAX tree ({sorted(saved)[:3]}...), "
                                  f"the module has {names[:3]}...: pass mapping= (a hybrid.core.ParamMapping) to "
                                  f"place its tensors")
        return ckpt
    from hybrid.checkpoint._renamed import to_torch_names
    return to_torch_names(open_checkpoint(path, format=format), mapping, shapes)


def saved_ddp_plan(ckpt: CheckpointReader, module: nn.Module) -> BucketPlan:
    """The rebuilt bucket plan the checkpoint recorded, once it is known to fit ``module``."""
    from hybrid.torch import DistributedDataParallel
    if not isinstance(module, DistributedDataParallel):
        raise TypeError(f"load(restore_buckets=True) restores hybrid.torch.DistributedDataParallel's buckets; "
                        f"got a {type(module).__name__}")
    saved = ckpt.manifest.run_state.get(DDP_PLAN_KEY)
    if saved is None:
        raise CheckpointError(f"{ckpt.path}: records no rebuilt DDP bucket plan (saved before the DDP's first "
                              f"rebuild, from a plain module, ZeRO3 or JAX, or by an older hybrid): load without "
                              f"restore_buckets")
    for key, value in saved["settings"].items():
        if module._layout_settings.get(key) != value:
            raise CheckpointError(f"{ckpt.path}: was saved from a DDP with {key}={value!r}, this one has "
                                  f"{module._layout_settings.get(key)!r}: the buckets would differ; build the DDP "
                                  f"as the saving run did, or load without restore_buckets")
    if module.find_unused_parameters and not module.static_graph:
        raise CheckpointError("restore_buckets: this DDP never rebuilds its buckets (find_unused_parameters=True "
                              "without static_graph), so there is no rebuilt plan to restore")
    plan = BucketPlan.from_json(saved["plan"])
    described = lambda specs: [(s.name, s.shape, s.dtype) for s in specs]  # noqa: E731
    if described(plan.specs) != described(module.bucket_plan.specs):
        raise CheckpointError(f"{ckpt.path}: its DDP bucket plan is over other tensors than this DDP's (another "
                              f"model, or parameters renamed or re-typed)")
    return plan


def _optimizer_state_dict(ckpt: CheckpointReader, named, optimizer, hyperparameters: str) -> dict[str, Any]:
    name_of = {id(p): n for n, p in named}
    order = _params_in_state_order(optimizer)
    unknown = [i for i, p in enumerate(order) if id(p) not in name_of]
    if unknown:
        raise CheckpointError(f"the optimizer steps {len(unknown)} tensors that are not parameters of the model")
    info, groups = saved_groups(ckpt, optimizer, name_of, hyperparameters)
    position = {n: i for i, n in enumerate(s.name for s in ckpt.manifest.plan.specs)}
    like_of = dict(named)
    kept = kept_states(optimizer)  # a ZeRO-1 rank keeps (so reads) only the state it owns
    saved = torch_states(ckpt, info, [like_of[s.name] for s in ckpt.manifest.plan.specs],
                         None if kept is None else {name_of[i] for i in kept})
    state = {}
    for i, p in enumerate(order):
        st = saved.get(position[name_of[id(p)]])
        if st is not None:
            state[i] = st
    out_groups, start = [], 0
    for group, size in zip(groups, _group_sizes(optimizer)):
        out_groups.append({**group, "params": list(range(start, start + size))})
        start += size
    return {"state": state, "param_groups": out_groups}
