"""Saving and loading a :class:`hybrid.torch.ZeRO3` run without gathering anything.

A ZeRO3 rank holds its flat slice of every bucket of its plan, parameters and optimizer state
alike: exactly a checkpoint file's contents. A save writes the slices as they are (the manifest
records ZeRO3's plan; loaders reshard by name, so the checkpoint loads anywhere), and a load
reads, from whatever plan and world size saved, just the elements of this rank's slices. The only
communication is one small object all-gather (which groups hold which state, their step counts)
and the save protocol's own.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybrid.checkpoint._formats import open_checkpoint
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint._manifest import CheckpointError, Manifest
from hybrid.checkpoint._protocol import begin_save
from hybrid.checkpoint.torch._groups import saved_groups
from hybrid.checkpoint.torch._commit import abandoned_on_failure, named_collective, write_and_commit
from hybrid.checkpoint.torch._state import (
    _NAME_OF_CLASS, SLOT_OF_TORCH_KEY, TORCH_KEY_OF_SLOT, _hyperparameters, _inner, expected_slots, named_buffers,
    optimizer_info)
from hybrid.checkpoint._write import buffer_entries, dtypes_of


def _numpy_slice(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A slice as stored: in its bucket's dtype (bfloat16, float8 as their bits: ``_dtypes``)."""
    from hybrid.checkpoint.torch._dtypes import to_numpy
    return to_numpy(t.detach().to(getattr(torch, dtype)))


def _torch_slice(a: np.ndarray, dtype: torch.dtype, device: torch.device, saved: str | None = None) -> torch.Tensor:
    """``a`` (stored bits of ``saved``, default ``dtype``) as a torch tensor: a view of the read
    buffer where no conversion is needed (what stays past the load is copied by the caller: a view
    would keep the whole buffer alive)."""
    from hybrid.checkpoint.torch._dtypes import from_numpy
    return from_numpy(a, dtype, saved).to(device=device)


def _group_state(optimizer) -> dict[int, tuple[int | None, list[str]]]:
    """``{group: (step count or None, torch state keys)}`` over every rank (a rank may hold no
    element of a small group): one object all-gather."""
    local: dict[int, tuple[int | None, list[str]]] = {}
    for seg, master in zip(optimizer._segments, optimizer._masters):
        st = optimizer.optim.state.get(master, {})
        step = st.get("step")
        keys = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() == 1)
        if st:
            local[seg.group] = (None if step is None else int(step.item() if torch.is_tensor(step) else step), keys)
    everyone: list = [None] * optimizer.world_size
    dist.all_gather_object(everyone, local, group=optimizer.process_group)
    out: dict[int, tuple[int | None, list[str]]] = {}
    for theirs in everyone:
        for g, (step, keys) in theirs.items():
            seen = out.setdefault(g, (step, keys))
            if seen != (step, keys):
                raise CheckpointError(f"ranks disagree on parameter group {g}'s state: {seen} and {(step, keys)}")
    return out


def save_zero3(path: str | os.PathLike, model, optimizer, *, step: int, extras: dict) -> Manifest | None:
    """:func:`hybrid.checkpoint.torch.save` of a ZeRO3 model (and its ZeRO3Optimizer): a collective."""
    group, rank, world_size = model.process_group, model.rank, model.world_size
    model._guard.enter("hybrid.checkpoint.torch.save")
    plan, shards = model.bucket_plan, model.shards
    names = model._names
    dtypes = [b.dtype for b in plan.buckets]
    tensors = {f"params/{b}": [_numpy_slice(s, dtypes[b])] for b, s in enumerate(model._buckets.slices)}
    info, kinds = None, ["params"]
    if optimizer is not None:
        if optimizer.module is not model:
            raise ValueError("save: the optimizer is not the ZeRO3Optimizer of this model")
        groups = _group_state(optimizer)
        group_names = [[names[i] for i in range(len(names)) if optimizer._group_of[i] == g]
                       for g in range(len(optimizer.param_groups))]
        counts = {n: groups[g][0] for g, ns in enumerate(group_names) if g in groups and groups[g][0] is not None
                  for n in ns}
        holders = {SLOT_OF_TORCH_KEY.get(k, k): {n for g, ns in enumerate(group_names) if g in groups
                                                   and k in groups[g][1] for n in ns}
                   for k in {k for _, keys in groups.values() for k in keys}}
        name_of = {id(p): n for p, n in zip(model._params, names)}
        inner = type(_inner(optimizer)).__name__
        info = optimizer_info(_NAME_OF_CLASS.get(inner, inner), expected_slots(optimizer),
                              _hyperparameters(optimizer, name_of), names, counts, holders, sgd_count=step)
        for slot in info.slots:
            key = TORCH_KEY_OF_SLOT.get(slot, slot)
            slices = [torch.zeros(n, dtype=torch.float32) for n in shards.shard_sizes]
            for seg, master in zip(optimizer._segments, optimizer._masters):
                value = optimizer.optim.state.get(master, {}).get(key)
                if isinstance(value, torch.Tensor):
                    slices[seg.bucket][seg.lo:seg.hi] = value
            tensors.update({f"{slot}/{b}": [_numpy_slice(s, dtypes[b])] for b, s in enumerate(slices)})
        kinds += list(info.slots)
    buffer_meta, buffer_tensors = buffer_entries(extras["buffers"], extras.get("buffer_dtypes"))
    # The save protocol of hybrid.checkpoint.torch.save's distributed path, with this rank's slices.
    body = Manifest("torch", world_size, 3, int(step), plan, info, dtypes_of(plan, kinds), (),
                    dict(extras["metadata"] or {}), buffer_meta, extras["run_state"])
    with abandoned_on_failure(path, rank):
        if rank == 0:
            begin_save(path)
        named_collective(path, "the barrier after the staging directory", dist.barrier, group=group)
        return write_and_commit(path, body, {**tensors, **buffer_tensors} if rank == 0 else tensors, rank,
                                world_size, group)


def load_zero3(path, model, optimizer, *, scheduler, hyperparameters: str, buffers: bool) -> int:
    """:func:`hybrid.checkpoint.torch.load` into a ZeRO3 model (and its ZeRO3Optimizer): each rank
    reads the elements of its own slices, from any saved plan and world size. Every check runs
    before anything changes."""
    ckpt = open_checkpoint(path, param_names=list(model._names))
    ckpt.check_model(model.bucket_plan.specs, what="ZeRO3")
    named_bufs = named_buffers(model) if buffers else []
    if buffers:
        if named_bufs and not ckpt.manifest.buffers:
            raise CheckpointError(f"{ckpt.path}: holds no buffers, but the model has {[n for n, _ in named_bufs]}: "
                                  f"load with buffers=False to keep the module's own")
        ckpt.check_buffers({n: tuple(b.shape) for n, b in named_bufs}, what="ZeRO3")
    if scheduler is not None:
        ckpt.scheduler_state()  # raises, naming the format read, where it holds none
    reshard = ckpt.reshard_to(model.shards)
    ckpt.verify(reshard.sources(model.rank))
    new_state, new_groups = None, None
    if optimizer is not None:  # first: offloaded, the state goes to new files, and its read buffers go
        new_state, new_groups = _optimizer_slices(ckpt, reshard, model, optimizer, hyperparameters, saved_groups)
    params = ckpt.slices("params", reshard, model.rank)
    saved_buffers = ckpt.buffers() if buffers else {}
    # Nothing has changed so far; from here on the inputs are all checked.
    with torch.no_grad():
        for s, a in zip(model._buckets.slices, params):
            s.copy_(_torch_slice(a, s.dtype, s.device))
        for name, b in named_bufs:
            b.copy_(_torch_slice(saved_buffers[name], b.dtype, b.device).reshape(b.shape))
    if optimizer is not None:
        optimizer._refresh_masters()
        optimizer.optim.state.clear()
        optimizer.optim.state.update(new_state)
        for group, restored in zip(optimizer.optim.param_groups, new_groups):
            group.update(restored)
    if scheduler is not None:
        scheduler.load_state_dict(ckpt.manifest.run_state["scheduler"])
    return ckpt.manifest.step


def _optimizer_slices(ckpt: CheckpointReader, reshard, model, optimizer, hyperparameters: str, saved_groups):
    """The inner optimizer's new state (per master segment) and groups' hyperparameters.

    Every check runs before any state is read. In memory, every slot is read in one pass over the
    files; with ``offload_dir``, one slot at a time, each moved into its files before the next is
    read, so the read buffers hold one slot of this rank's slices at most."""
    names = model._names
    info, groups = saved_groups(ckpt, optimizer, {id(p): n for p, n in zip(model._params, names)}, hyperparameters)
    state: dict[torch.Tensor, dict[str, Any]] = {}
    wanted: dict[str, list[tuple[Any, torch.Tensor]]] = {slot: [] for slot in info.slots}  # slot -> segments
    for seg, master in zip(optimizer._segments, optimizer._masters):
        members = [names[s.tensor] for s in model.shards.member_slices(seg.bucket, model.rank)
                   if s.shard_offset < seg.hi and s.shard_offset + s.stop - s.start > seg.lo]
        with_state = {n for n in members if info.has_state(n)}
        if not with_state:
            continue
        counts = {info.count_of(n) for n in members}
        if with_state != set(members) or len(counts) > 1:
            raise CheckpointError(f"{ckpt.path}: parameters {sorted(members)} share one flat run of ZeRO3's slices "
                                  f"but were saved with different optimizer state (state for {sorted(with_state)}, "
                                  f"step counts {sorted(counts)}): a flat run steps as one tensor")
        state[master] = {} if info.name == "sgd" else {"step": torch.tensor(float(counts.pop()))}
        for slot in info.slots:
            held = [n for n in members if info.holds(slot, n)]
            if held and len(held) != len(members):
                raise CheckpointError(f"{ckpt.path}: {slot} is saved for {held} but not for the other parameters "
                                      f"of their flat run {sorted(set(members) - set(held))}")
            if held:
                wanted[slot].append((seg, master))
    passes = [list(info.slots)] if optimizer._files is None else [[slot] for slot in info.slots]
    for slots in passes:
        read = ckpt.slices_of(slots, reshard, [model.rank])
        for slot in slots:
            for seg, master in wanted[slot]:
                state[master][TORCH_KEY_OF_SLOT.get(slot, slot)] = optimizer._keep_state(
                    _torch_slice(read[slot, model.rank][seg.bucket][seg.lo:seg.hi], torch.float32, master.device,
                                 model.bucket_plan.buckets[seg.bucket].dtype))
        del read
    return state, groups
