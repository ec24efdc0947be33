"""Saving torch runs: a DDP model with ZeroRedundancyOptimizer, ZeRO2 or a plain ``torch.optim``
optimizer (and its LR scheduler, buffers and the user's state), or torch's own ``state_dict()``s.

Every rank writes its own file (its flat slice of every bucket of the checkpoint plan) and rank 0
writes the manifest last.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybrid.core import BucketPlan, plan_buckets, rebuild_plan, shard_flat
from hybrid.checkpoint._files import storage_dtype
from hybrid.checkpoint._protocol import begin_save
from hybrid.checkpoint._manifest import DDP_PLAN_KEY, CheckpointError, Manifest
from hybrid.checkpoint._write import buffer_entries, check_json, dtypes_of, rank_tensors, save_arrays, slice_pieces
from hybrid.checkpoint.torch._commit import abandoned_on_failure, named_collective, write_and_commit
from hybrid.checkpoint.torch._zero3 import save_zero3
from hybrid.checkpoint.torch._state import (
    _NAME_OF_CLASS, _fill_slots, _hyperparameters, _inner, _is_zero1, _is_zero2, _is_zero3,
    _local_states, _numpy, _slots_and_count, _specs, ddp_buckets, expected_slots, named_buffers, named_parameters,
    optimizer_info)

def save(path: str | os.PathLike, module: nn.Module, optimizer=None, *, step: int, process_group=None,
         world_size: int | None = None, scheduler=None, state: dict | None = None,
         metadata: dict | None = None, other_state: dict | None = None) -> Manifest | None:
    """Save ``module``'s parameters and buffers, ``optimizer``'s state and hyperparameters, the LR
    ``scheduler``'s state and the user's ``state`` as a sharded checkpoint.

    Under ``torch.distributed`` this is a collective: call it on every rank of ``process_group``;
    each rank writes its own file, rank 0 the manifest, and all return once it is in place (rank
    0 gets the :class:`~hybrid.checkpoint.Manifest`, the others ``None``). Without a process
    group it writes ``world_size`` files (default 1) from this process: a checkpoint made from a
    plain model and ``torch.optim`` optimizer, loadable at any world size.

    Args:
      path: the checkpoint directory; an existing one is replaced only once the save is complete.
      module: the model, bare or wrapped in (hybrid's or torch's) DistributedDataParallel, or a
        ``hybrid.torch.ZeRO3`` (each rank then writes its slices as they are, with ZeRO3's plan:
        nothing is gathered). Its persistent buffers (BatchNorm statistics, ...) are saved
        once, from rank 0's copy.
      optimizer: a ``hybrid.torch.ZeroRedundancyOptimizer`` (also with overlap hooks), ``ZeRO2``,
        ``ZeRO3Optimizer`` (with its ZeRO3), torch's ``ZeroRedundancyOptimizer`` or a plain Adam
        / AdamW (AMSGrad too) / SGD; None saves no optimizer state. Parameters without state
        yet are recorded as such.
      step: the training step to record (returned by :func:`load`).
      process_group: the group that shards the state (default: the world, if initialised).
      world_size: only without a process group: how many rank files to write.
      scheduler: an LR scheduler whose ``state_dict()`` is saved (``load(..., scheduler=)``).
      state: JSON-serializable run state (data-loader position, seeds, epoch), given back by
        :func:`hybrid.checkpoint.read_state`.
      metadata: JSON-able extras recorded in the manifest.
      other_state: the rest of the run as ``Stateful`` objects give it, nested (a torchtitan run's
        ``{"dataloader": loader.state_dict(), "train_state": ...}``: bytes, numbers, tensors):
        carried, given back by :func:`hybrid.checkpoint.torch.other_state` and written where it
        was by ``convert(..., to="dcp")``.

    >>> import torch, tempfile, os
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save(d, model, opt, step=1, world_size=2, state={"epoch": 3}).optimizer.slots
    ('mu', 'nu')
    """
    from hybrid.checkpoint.torch._dtypes import check_tensors, logical_dtypes
    module = getattr(module, "_orig_mod", module)  # torch.compile(model): the model it runs
    # Every dtype checked before anything is written (on every rank alike: nobody waits on a file).
    check_tensors([*named_parameters(module), *named_buffers(module)], where=f"save {path}")
    if _is_zero3(module):  # each rank writes its slices as they are: nothing is gathered
        return save_zero3(path, module, optimizer, step=step, extras=dict(
            metadata=metadata, buffers={n: _numpy(b) for n, b in named_buffers(module)},
            buffer_dtypes=logical_dtypes(named_buffers(module)),
            run_state=_run_state(scheduler, state, other_state, path)))
    named = named_parameters(module)
    name_of = {id(p): n for n, p in named}
    plan = plan_buckets(_specs(named))
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and world_size is not None and world_size != dist.get_world_size(process_group):
        raise ValueError(f"save: world_size={world_size} given, but the process group has "
                         f"{dist.get_world_size(process_group)} ranks; each rank writes its own file")
    run_state = _run_state(scheduler, state, other_state, path)
    buckets = ddp_buckets(module)
    if buckets is not None:  # for load(..., restore_buckets=True)
        run_state[DDP_PLAN_KEY] = buckets
    states, complete = _local_states(optimizer) if optimizer is not None else ({}, True)
    slots, counts = _slots_and_count(named, states)
    describe = None if optimizer is None else _describer(optimizer, named, name_of, step)
    stage = 2 if _is_zero2(optimizer) else 1 if _is_zero1(optimizer) else 0
    params = {n: _numpy(p) for n, p in named}
    buffers = {n: _numpy(b) for n, b in named_buffers(module)}
    extras = dict(metadata=metadata, buffers=buffers, run_state=run_state,
                  buffer_dtypes=logical_dtypes(named_buffers(module)))
    if not distributed:
        info = describe(counts, {s: set(v) for s, v in slots.items()}) if describe else None
        return save_arrays(path, params, world_size=world_size or 1, step=step, slots=_fill_slots(params, slots, info),
                           optimizer=info, plan=plan, stage=stage, framework="torch", **extras)
    with abandoned_on_failure(path, dist.get_rank(process_group)):
        return _save_distributed(path, params, slots, counts, describe, complete, plan, step, stage, process_group,
                                 extras)


def _describer(optimizer, named, name_of, step):
    """``describe(counts, holders) -> OptimizerInfo`` once every rank's state is known."""
    inner_name = type(_inner(optimizer)).__name__
    name, expected = _NAME_OF_CLASS.get(inner_name, inner_name), expected_slots(optimizer)
    hyper, names = _hyperparameters(optimizer, name_of), [n for n, _ in named]
    return lambda counts, holders: optimizer_info(name, expected, hyper, names, counts, holders, sgd_count=step)


def _run_state(scheduler, state, other_state=None, path=None) -> dict:
    out = {}
    if other_state:  # checked, like everything else, before anything is written
        from hybrid.checkpoint.torch._other_state import carried_of
        out["carried"] = carried_of(other_state, where=f"save {path}: other_state")
    if state is not None:
        out["state"] = check_json(dict(state), "state")
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
        check_json(out["scheduler"], f"{type(scheduler).__name__}.state_dict()")
    return out


def _save_distributed(path, params, slots, counts, describe, complete, plan, step, stage, group, extras):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        begin_save(path)  # the collective below tells every rank it is done: no barrier of its own
    # One object collective settles what every rank must agree on before any data moves: each
    # parameter's step count and which slots it holds, wherever its state lives.
    mine = (counts, {s: sorted(v) for s, v in slots.items()})
    everyone: list = [None] * world_size
    named_collective(path, "the all_gather_object of step counts", dist.all_gather_object, everyone, mine, group=group)
    all_counts, holders = {}, {}
    for r, (their_counts, their_slots) in enumerate(everyone):
        for name, c in their_counts.items():
            if all_counts.setdefault(name, c) != c:
                raise CheckpointError(f"ranks disagree on the step count of {name!r} ({all_counts[name]} and {c} "
                                      f"on rank {r})")
        for s, names in their_slots.items():
            holders.setdefault(s, set()).update(names)
    info = describe(all_counts, holders) if describe else None
    names = [s.name for s in plan.specs]
    kinds = ["params", *(info.slots if info else ())]
    arrays = {"params": [params[n] for n in names]}
    if complete:
        arrays.update({slot: [a[n] for n in names] for slot, a in _fill_slots(params, slots, info).items()})
    else:
        owners = {s: {n: r for r, (_, theirs) in enumerate(everyone) for n in theirs.get(s, ())} for s in kinds[1:]}
        plan = _owner_ordered(plan, owners)
    tensors = rank_tensors(plan, world_size, rank, arrays=arrays)
    if not complete:
        tensors.update(_exchange_slots(path, plan, group, slots, owners))
    buffer_meta, buffer_tensors = buffer_entries(extras["buffers"], extras.get("buffer_dtypes"))
    # Every rank builds the same manifest body (the file list aside): its digest goes in each file.
    body = Manifest("torch", world_size, stage, int(step), plan, info, dtypes_of(plan, kinds),
                    (), dict(extras["metadata"] or {}), buffer_meta, extras["run_state"])
    return write_and_commit(path, body, {**tensors, **buffer_tensors} if rank == 0 else tensors, rank, world_size,
                            group)


def _owner_ordered(plan: BucketPlan, owners: dict[str, dict[str, int]]) -> BucketPlan:
    """The checkpoint plan of a ZeRO-1 save: the tensors in order of the rank owning their state
    (state-less ones last), one bucket per dtype. Its equal slices then follow the owners, so a
    rank's file is, up to the partition's imbalance, the state it holds: only the elements on the
    wrong side of a cut move between ranks. Any plan loads anywhere (the loader reshards by name).

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(n, (4,), "float32") for n in "abc"])
    >>> _owner_ordered(plan, {"mu": {"a": 1, "b": 0, "c": 1}}).bucket_indices()
    [[1, 0, 2]]
    """
    def owner(i):
        found = [by_name[plan.specs[i].name] for by_name in owners.values() if plan.specs[i].name in by_name]
        return min(found, default=len(plan.specs) + 1)

    order = sorted(range(len(plan.specs)), key=lambda i: (owner(i), i))
    return rebuild_plan(plan, order, size_limits=[1 << 62])


def _exchange_slots(path, plan, group, slots, owners) -> dict[str, list[np.ndarray]]:
    """This rank's slices of the optimizer slots of a ZeRO-1 run, whose ranks each hold the whole
    state of the tensors they own (``owners[slot][name]``): every owner sends each other rank the
    parts of its tensors that lie in that rank's slices, one message per pair of ranks (no zeros,
    no sums: half the bytes of a reduce per slice, and no packed copy of the buckets)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shards = shard_flat(plan, world_size)
    names = [s.name for s in plan.specs]
    dtypes = [storage_dtype(b.dtype) for b in plan.buckets]

    def message(src: int, dst: int):
        """What ``src`` sends ``dst``: ``[(slot, bucket, member slice, byte offset)]`` and the size,
        in an order every rank computes alike; pieces 8-byte aligned so they view as any dtype."""
        items, size = [], 0
        for slot in owners:
            for b in range(plan.num_buckets):
                for m in shards.member_slices(b, dst):
                    if owners[slot].get(names[m.tensor]) == src:
                        items.append((slot, b, m, size))
                        size += -(-(m.stop - m.start) * dtypes[b].itemsize // 8) * 8
        return items, size

    peer = lambda r: dist.get_global_rank(group, r) if group is not None else r
    works, received = [], {}
    for other in range(world_size):
        if other == rank:
            continue
        items, size = message(rank, other)
        if size:
            out = np.empty(size, np.uint8)
            for slot, b, m, at in items:
                piece = slots[slot][names[m.tensor]].reshape(-1)[m.start:m.stop]
                out[at:at + piece.nbytes] = piece.view(np.uint8)
            works.append(dist.isend(torch.from_numpy(out), peer(other), group=group))
        items, size = message(other, rank)
        if size:
            into = np.empty(size, np.uint8)
            works.append(dist.irecv(torch.from_numpy(into), peer(other), group=group))
            for slot, b, m, at in items:
                n = (m.stop - m.start) * dtypes[b].itemsize
                received[slot, b, m.tensor] = into[at:at + n].view(dtypes[b])
    for w in works:
        named_collective(path, "the exchange of optimizer state between ranks", w.wait)

    def piece(slot, b, m):
        owner = owners[slot].get(names[m.tensor])
        if owner == rank:
            return slots[slot][names[m.tensor]].reshape(-1)[m.start:m.stop]
        if owner is None:  # no state anywhere yet: zeros on disk, the manifest says none is restored
            return np.zeros(m.stop - m.start, dtypes[b])
        return received[slot, b, m.tensor]

    return {f"{slot}/{b}": slice_pieces(shards, b, rank, piece=lambda m, slot=slot, b=b: piece(slot, b, m))
            for slot in owners for b in range(plan.num_buckets)}


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
        named = [(n, model_state_dict[n]) for n in names]
        states = {id(model_state_dict[n]): state[i] for i, n in enumerate(names) if state.get(i)}
        slots, counts = _slots_and_count(named, states)
        keys = {k for st in state.values() for k in st}
        name = optimizer or ("adam" if "exp_avg" in keys else "sgd")
        groups = []
        for g in optimizer_state_dict.get("param_groups", []):
            group = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**group, "param_names": [names[i] for i in g["params"] if i < len(names)]})
        if name in ("adam", "adamw"):
            expected = ("mu", "nu", "max_nu") if "max_nu" in slots else ("mu", "nu")
        else:
            expected = tuple(sorted(slots))
        info = optimizer_info(name, expected, {"param_groups": groups}, names, counts,
                              {s: set(v) for s, v in slots.items()}, sgd_count=step)
        slots = _fill_slots(params, slots, info)
    specs = _specs([(n, model_state_dict[n]) for n in names])
    return save_arrays(path, params, world_size=world_size, step=step, slots=slots, optimizer=info,
                       plan=plan_buckets(specs), stage=0, framework="torch", metadata=metadata)
