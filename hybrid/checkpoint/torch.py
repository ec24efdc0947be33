"""Sharded checkpoints from and into torch: a DDP model with ZeroRedundancyOptimizer, ZeRO2 or a
plain ``torch.optim`` optimizer, and torch's own ``state_dict()`` formats.

Every rank writes its own file (its flat slice of every bucket of the checkpoint plan) and rank 0
writes the manifest last; loading reads the slices it needs at any saved world size.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybrid.core import pack, plan_buckets, shard_flat
from hybrid.checkpoint._files import Checkpoint, write_shard
from hybrid.checkpoint._protocol import begin_save, commit_save
from hybrid.checkpoint._manifest import CheckpointError, Manifest, OptimizerInfo
from hybrid.checkpoint._write import _stored_plan, dtypes_of, rank_tensors, save_arrays
from hybrid.checkpoint._torch_state import (
    TORCH_KEY_OF_SLOT, _NAME_OF_CLASS, _fill_slots, _group_sizes, _hyperparameters, _inner, _is_zero1, _is_zero2,
    _local_states, _numpy, _params_in_state_order, _slots_and_count, _specs, _torch, _unwrap, expected_slots,
    named_parameters)

# -- save -------------------------------------------------------------------------------------------

def save(path: str | os.PathLike, module: nn.Module, optimizer=None, *, step: int, process_group=None,
         world_size: int | None = None, metadata: dict | None = None) -> Manifest | None:
    """Save ``module``'s parameters and ``optimizer``'s state as a sharded checkpoint.

    Under ``torch.distributed`` this is a collective: call it on every rank of ``process_group``;
    each rank writes its own file, rank 0 the manifest, and all return once it is in place (rank
    0 gets the :class:`~hybrid.checkpoint.Manifest`, the others ``None``). Without a process
    group it writes ``world_size`` files (default 1) from this process: a checkpoint made from a
    plain model and ``torch.optim`` optimizer, loadable at any world size.

    Args:
      path: the checkpoint directory; an existing one is replaced only once the save is complete.
      module: the model, bare or wrapped in (hybrid's or torch's) DistributedDataParallel.
      optimizer: a ``hybrid.torch.ZeroRedundancyOptimizer`` (also with overlap hooks), ``ZeRO2``,
        torch's ``ZeroRedundancyOptimizer`` or a plain Adam / AdamW / SGD; None saves parameters.
      step: the training step to record (returned by :func:`load`).
      process_group: the group that shards the state (default: the world, if initialised).
      world_size: only without a process group: how many rank files to write.
      metadata: JSON-able extras recorded in the manifest.

    >>> import torch, tempfile, os
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save(d, model, opt, step=1, world_size=2).optimizer.slots
    ('mu', 'nu')
    """
    named = named_parameters(module)
    specs = _specs(named)
    plan = plan_buckets(specs)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and world_size is not None and world_size != dist.get_world_size(process_group):
        raise ValueError(f"save: world_size={world_size} given, but the process group has "
                         f"{dist.get_world_size(process_group)} ranks; each rank writes its own file")
    states, complete = _local_states(optimizer) if optimizer is not None else ({}, True)
    slots, count = _slots_and_count(named, states)
    if count is None and slots:
        # SGD counts no steps (nor does optax's trace); its buffers exist once it has stepped.
        count = int(step)
    info = None
    if optimizer is not None:
        info = OptimizerInfo(_NAME_OF_CLASS.get(type(_inner(optimizer)).__name__, type(_inner(optimizer)).__name__),
                             expected_slots(optimizer), 0, _hyperparameters(optimizer))
    stage = 2 if _is_zero2(optimizer) else 1 if _is_zero1(optimizer) else 0
    params = {n: _numpy(p) for n, p in named}
    if not distributed:
        return _save_whole(path, params, slots, count, info, plan, world_size or 1, step, stage, metadata)
    return _save_distributed(path, params, slots, count, info, complete, plan, step, stage,
                             process_group, metadata)


def _save_whole(path, params, slots, count, info, plan, world_size, step, stage, metadata):
    full = _fill_slots(params, slots, info)
    if info is not None:
        info = OptimizerInfo(info.name, info.slots, count or 0, info.hyperparameters)
    return save_arrays(path, params, world_size=world_size, step=step, slots=full, optimizer=info, plan=plan,
                       stage=stage, framework="torch", metadata=metadata)


def _collective(path, what: str, fn, *args, **kwargs):
    """Run a collective of a save; a peer that died or stalled becomes an error naming the save."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"saving checkpoint {path}: rank {dist.get_rank()} failed in {what} (a peer died, "
                           f"stalled past the process group's timeout, or left); the previous checkpoint at "
                           f"this path is untouched. Cause: {e}") from e


def _save_distributed(path, params, slots, count, info, complete, plan, step, stage, group, metadata):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # One object collective settles what every rank must agree on before any data moves.
    mine = (count, sorted(slots))
    everyone: list = [None] * world_size
    _collective(path, "the all_gather_object of step counts", dist.all_gather_object, everyone, mine, group=group)
    counts = {c for c, _ in everyone if c is not None}
    if len(counts) > 1:
        raise CheckpointError(f"ranks hold optimizer states of different step counts {sorted(counts)}")
    if info is not None:
        info = OptimizerInfo(info.name, info.slots, counts.pop() if counts else 0, info.hyperparameters)
    shards = shard_flat(plan, world_size)
    stored = _stored_plan(plan)
    names = [s.name for s in plan.specs]

    def flats(arrays):
        ordered = [arrays[n] for n in names]
        return [pack(stored, b, ordered, length=shards.padded_length(b)) for b in range(plan.num_buckets)]

    all_arrays = {"params": [params[n] for n in names]}
    all_flats = {}
    for slot, arrays in _fill_slots(params, slots, info).items():
        if complete:
            all_arrays[slot] = [arrays[n] for n in names]
            continue
        # Each rank holds whole tensors of its own share (zeros elsewhere). Summing slice r over the
        # ranks onto rank r gives rank r its slice of the whole state, exactly (x + 0 == x): one
        # reduce per slice moves half the bytes an all-reduce would.
        per_bucket = flats(arrays)
        works = []
        for b, flat in enumerate(per_bucket):
            t = torch.from_numpy(flat.view(np.int16) if flat.dtype == np.uint16 else flat)
            if flat.dtype == np.uint16:
                t = t.view(torch.bfloat16)
            for r in range(world_size):
                lo, hi = shards.shard_range(b, r)
                if hi > lo:
                    works.append(_collective(path, f"the reduce of {slot} bucket {b} onto rank {r}", dist.reduce,
                                             t[lo:hi], dst=dist.get_global_rank(group, r) if group else r,
                                             group=group, async_op=True))
        for w in works:
            _collective(path, f"the reduces of {slot}", w.wait)
        all_flats[slot] = per_bucket
    if rank == 0:
        begin_save(path)
    _collective(path, "the barrier before writing", dist.barrier, group=group)
    # Every rank builds the same manifest body (the file list aside): its digest goes in each file.
    body = Manifest("torch", world_size, stage, int(step), plan, info, dtypes_of(plan, [*all_arrays, *all_flats]),
                    (), dict(metadata or {}))
    entry = write_shard(path, rank, world_size, rank_tensors(plan, world_size, rank, flats=all_flats, arrays=all_arrays),
                        body_digest=body.body_digest())
    entries: list = [None] * world_size
    _collective(path, "the all_gather_object of file checksums", dist.all_gather_object, entries, entry, group=group)
    manifest = None
    if rank == 0:
        manifest = dataclasses.replace(body, files=tuple(entries))
        commit_save(path, manifest)
    # Nobody returns (and perhaps loads) before the manifest is in place.
    _collective(path, "the barrier after the manifest", dist.barrier, group=group)
    return manifest


def save_state_dicts(path: str | os.PathLike, model_state_dict: dict[str, torch.Tensor],
                     optimizer_state_dict: dict[str, Any] | None = None, *, step: int = 0, world_size: int = 1,
                     param_names: list[str] | None = None, optimizer: str | None = None,
                     metadata: dict | None = None) -> Manifest:
    """A sharded checkpoint from torch's dicts: ``model.state_dict()`` and a plain optimizer's
    ``state_dict()`` (or what ``ZeroRedundancyOptimizer.consolidate_state_dict`` +
    ``state_dict()`` gives), state index ``i`` being parameter ``param_names[i]``.

    Args:
      param_names: the parameters in the optimizer's order (default: every entry of
        ``model_state_dict``, which is right for models without buffers).
      optimizer: "adam", "adamw" or "sgd" (default: "adam" if the state has ``exp_avg``).

    >>> import torch, tempfile, os
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters())
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_state_dicts(d, model.state_dict(), opt.state_dict(), step=1, world_size=2).optimizer.count
    1
    """
    names = list(model_state_dict) if param_names is None else list(param_names)
    missing = [n for n in names if n not in model_state_dict]
    if missing:
        raise ValueError(f"save_state_dicts: param_names {missing} are not in the model state dict")
    params = {n: _numpy(model_state_dict[n]) for n in names}
    info, slots = None, {}
    if optimizer_state_dict is not None:
        state = optimizer_state_dict["state"]
        counted = [i for i in range(len(names)) if state.get(i)]
        if counted and len(counted) != len(names):
            raise ValueError(f"save_state_dicts: parameters {[names[i] for i in range(len(names)) if i not in counted]} "
                             f"have no optimizer state while others do")
        named = [(n, model_state_dict[n]) for n in names]
        states = {id(model_state_dict[n]): state[i] for i, n in enumerate(names) if state.get(i)}
        slots, count = _slots_and_count(named, states)
        keys = {k for st in state.values() for k in st}
        name = optimizer or ("adam" if "exp_avg" in keys else "sgd")
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in optimizer_state_dict.get("param_groups", [])]
        info = OptimizerInfo(name, ("mu", "nu") if name in ("adam", "adamw") else tuple(sorted(slots)),
                             count if count is not None else (int(step) if slots else 0), {"param_groups": groups})
        slots = _fill_slots(params, slots, info)
    specs = _specs([(n, model_state_dict[n]) for n in names])
    return save_arrays(path, params, world_size=world_size, step=step, slots=slots, optimizer=info,
                       plan=plan_buckets(specs), stage=0, framework="torch", metadata=metadata)


# -- load -------------------------------------------------------------------------------------------

def state_dicts(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint as torch's two dicts: ``model.state_dict()``'s parameters by name, and the
    optimizer state dict of a plain optimizer over ``model.parameters()`` (the format
    ``ZeroRedundancyOptimizer.consolidate_state_dict`` + ``state_dict()`` gives).

    >>> import torch, tempfile, os
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, model, opt, step=1)
    >>> model_sd, opt_sd = state_dicts(d)
    >>> sorted(model_sd), sorted(opt_sd["state"][0])
    (['bias', 'weight'], ['momentum_buffer'])
    """
    ckpt = Checkpoint(path)
    ckpt.verify()
    specs = ckpt.manifest.plan.specs
    likes = [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in specs]
    params = ckpt.tensors("params")
    model = {s.name: _torch(params[s.name], like) for s, like in zip(specs, likes)}
    info = ckpt.manifest.optimizer
    if info is None:
        return model, {"state": {}, "param_groups": []}
    state = _torch_state(ckpt, info, likes)
    groups = info.hyperparameters.get("param_groups") or [{}]
    if len(groups) != 1:
        raise CheckpointError(f"{ckpt.path}: saved with {len(groups)} parameter groups; state_dicts() gives one "
                              "group over all parameters, load with load() into your optimizer instead")
    return model, {"state": state, "param_groups": [{**groups[0], "params": list(range(len(specs)))}]}


def _torch_state(ckpt: Checkpoint, info: OptimizerInfo, likes: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """Torch's per-parameter state (checkpoint order) from the slots; empty before the first step."""
    if info.count == 0:
        return {}
    slots = {s: ckpt.tensors(s) for s in info.slots}
    state = {}
    for i, (spec, like) in enumerate(zip(ckpt.manifest.plan.specs, likes)):
        st: dict[str, Any] = {"step": torch.tensor(float(info.count))} if info.name != "sgd" else {}
        for slot in info.slots:
            st[TORCH_KEY_OF_SLOT.get(slot, slot)] = _torch(slots[slot][spec.name], like)
        state[i] = st
    return state


def load(path: str | os.PathLike, module: nn.Module, optimizer=None) -> int:
    """Load a checkpoint (saved by either frontend, at any world size) into ``module`` and
    ``optimizer``; returns the saved step.

    Every file is checked (size, SHA-256, contents) and every tensor matched to the model by name,
    shape and dtype before anything changes: a bad checkpoint raises
    :class:`~hybrid.checkpoint.CheckpointError` naming the file and leaves parameters and optimizer
    state as they were. Call it on every rank (it reads files, it does not communicate). The
    optimizer's hyperparameters (learning rate, ...) stay those it was built with.

    >>> import torch, tempfile, os
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, model, opt, step=5, world_size=3)
    >>> other = torch.nn.Linear(3, 2); load(d, other, torch.optim.Adam(other.parameters(), lr=0.1))
    5
    >>> torch.equal(other.weight, model.weight)
    True
    """
    ckpt = Checkpoint(path)
    named = named_parameters(module)
    ckpt.check_model(_specs(named), what=type(_unwrap(module)).__name__)
    ckpt.verify()
    params = ckpt.tensors("params")
    new_params = [_torch(params[n], p) for n, p in named]
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = _optimizer_state_dict(ckpt, named, optimizer)
    # Nothing has changed so far; from here on the inputs are all checked.
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    with torch.no_grad():
        for (_, p), value in zip(named, new_params):
            p.copy_(value)
    return ckpt.manifest.step


def _optimizer_state_dict(ckpt: Checkpoint, named, optimizer) -> dict[str, Any]:
    info = ckpt.manifest.optimizer
    if info is None:
        raise CheckpointError(f"{ckpt.path}: holds no optimizer state (saved without an optimizer)")
    want = expected_slots(optimizer)
    if set(info.slots) != set(want):
        raise CheckpointError(f"{ckpt.path}: holds {info.name} state {list(info.slots)}, but "
                              f"{type(_inner(optimizer)).__name__} keeps {list(want)}")
    position = {n: i for i, n in enumerate(s.name for s in ckpt.manifest.plan.specs)}
    name_of = {id(p): n for n, p in named}
    order = _params_in_state_order(optimizer)
    unknown = [i for i, p in enumerate(order) if id(p) not in name_of]
    if unknown:
        raise CheckpointError(f"the optimizer steps {len(unknown)} tensors that are not parameters of the model")
    like_of = dict(named)
    saved = _torch_state(ckpt, info, [like_of[s.name] for s in ckpt.manifest.plan.specs])
    state = {}
    for i, p in enumerate(order):
        st = saved.get(position[name_of[id(p)]])
        if st is not None:
            state[i] = st
    groups, start = [], 0
    for group, size in zip(optimizer.param_groups, _group_sizes(optimizer)):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + size))})
        start += size
    return {"state": state, "param_groups": groups}
