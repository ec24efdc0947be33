"""ZeRO3 on a module built on the meta device: every rank initialises the model one unit at a time
and keeps only its slices, so no rank ever holds the whole model.

An *initialisation unit* is one module holding parameters or buffers of its own: its tensors are
materialised on the CPU (and any tensor of the model its initialiser touches), its initialiser
runs (``init_fn(module)``, else ``module.reset_parameters()``), this rank copies its elements of
each parameter into its slices, and the full tensors are dropped. Buffers and frozen parameters
stay whole on every rank. Units run in ``module.modules()`` order, every module holding tensors
(tied ones included), on rank 0's CPU RNG state (sent to every rank first, as DDP takes rank 0's
values), so each rank runs the same draws in the same order and the slices are bit for bit those of
this loop on the CPU::

    for m in model.modules():                 # a CPU build of the same model, the same seed
        if m._parameters or m._buffers:
            init_fn(m) if init_fn else m.reset_parameters()

For torch's own layers (``reset_parameters`` is what their constructors call), a plain CPU build
in the same order gives the same values. A tensor written by two units (a tied weight) ends with
the last write, as in that loop; a later unit may overwrite a finished tensor but not read it.

A unit is what its initialiser touches: one that initialises its children too materialises them
with it. Give a per-module ``init_fn`` one module's own tensors at a time to keep a unit small.

An ``init_fn`` that takes no arguments (torchtitan's root ``model.init_weights``, with or without its
``buffer_device=None``) is the whole model's initialiser: it is called once, as on a CPU build, with
each parameter materialised only while it uses it (``_init_whole``).

Every tensor a unit should set is checked to have been written (an in-place op on its memory: the
``nn.init`` functions, ``copy_``, ``fill_``, ...); one that was not, or a module holding meta tensors
and no initialiser, is refused naming the tensor and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybrid.core import FlatShardPlan
from hybrid.torch.zero.zero3._init_tensors import _Units, _Writes, _describe, _finish, _swap, _tensors, _use_rank0_rng
from hybrid.torch.zero.zero3._init_whole import initialise_whole_model, is_whole_model_initialiser

_FIX = ("give ZeRO3(..., init_fn=fn), fn(module) initialising the module's own parameters and buffers in place "
        "(nn.init.*, .copy_(), .fill_(); it is called on every module holding tensors, as FSDP's param_init_fn), "
        "or define reset_parameters() on {cls}")


def is_meta_module(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialise(module: nn.Module, params: list[nn.Parameter], shards: FlatShardPlan, rank: int, *,
                init_fn: Callable[[nn.Module], None] | None, device: torch.device, group) -> list[torch.Tensor]:
    """Initialise the meta module unit by unit; returns this rank's slice of every bucket of
    ``shards`` (``params``: the sharded parameters, indexed as its specs). Buffers and parameters
    left unsharded end materialised on ``device``; the sharded ones stay meta (ZeRO3 makes them
    stand-ins). A collective (rank 0's RNG state is broadcast)."""
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable taking a module (called per module) or nothing (called once, "
                        f"for the whole model), got {init_fn!r}")
    spec_of = {id(p): i for i, p in enumerate(params)}
    real = [n for n, p in module.named_parameters() if id(p) in spec_of and not p.is_meta]
    if real:
        meta = [n for n, p in module.named_parameters() if p.is_meta]
        raise ValueError(f"ZeRO3: parameters {meta[:3]} are on the meta device but {real[:3]} are not: build the "
                         f"whole model on the meta device (with torch.device('meta'): ...), or none of it")
    plan = shards.bucket_plan
    slices = [torch.zeros(shards.shard_sizes[b], dtype=getattr(torch, plan.buckets[b].dtype), device=device)
              for b in range(plan.num_buckets)]
    pieces: dict[int, list] = {}
    for b in range(plan.num_buckets):
        for s in shards.member_slices(b, rank):
            pieces.setdefault(s.tensor, []).append((b, s.start, s.stop, s.shard_offset))
    entries, units = _tensors(module, spec_of)
    if init_fn is not None and is_whole_model_initialiser(init_fn):
        initialise_whole_model(module, init_fn, entries, units, slices, pieces, shards=shards, rank=rank,
                               device=device, group=group)
        return slices
    _use_rank0_rng(group)
    for m, prefix, held in units:
        unit = _describe(prefix, m)
        initialiser = (lambda m=m: init_fn(m)) if init_fn is not None else getattr(m, "reset_parameters", None)
        pending = [e for _, _, e in held if e.status == "meta"]
        if initialiser is None:
            if pending:
                raise ValueError(f"ZeRO3: {pending[0].name!r} is on the meta device and nothing initialises it: "
                                 f"{unit} has no reset_parameters(); " + _FIX.format(cls=type(m).__name__))
            continue
        run = _Units(entries, unit)
        for e in pending:
            run.materialise(e)
        with run, _Writes(run):
            initialiser()
        _check_unit(m, held, run, unit)
        for e in run.live:
            _finish(e, slices, pieces, device)
    return slices


def _check_unit(m: nn.Module, held, run: _Units, unit: str) -> None:
    for kind, attr, e in held:
        now = getattr(m, kind).get(attr)
        if now is not e.tensor:
            if kind == "_buffers" and isinstance(now, torch.Tensor) and not now.is_meta:
                # A buffer assigned anew (self.mask = torch.tril(...)): the module holds the new one.
                e.tensor, e.written, e.status = now, True, "done"
                if e in run.live:
                    run.live.remove(e)
                continue
            raise ValueError(f"ZeRO3 initialisation: {unit}'s initialiser replaced {e.name!r} with another object; "
                             f"initialise it in place (nn.init.*, .copy_(), .fill_()): ZeRO3 shards the object "
                             f"the module was built with")
    for e in run.live:
        if e.written:
            continue
        if any(e is h for _, _, h in held):
            raise ValueError(f"ZeRO3: {e.name!r} is on the meta device and {unit}'s initialiser did not set it "
                             f"(no in-place write to it); " + _FIX.format(cls=type(m).__name__)
                             + (" (a buffer computed in __init__, such as a causal mask, must be set there too)"
                                if e.spec is None and not isinstance(e.tensor, nn.Parameter) else ""))
        # Touched (read) by another module's initialiser but not written: it waits for its own unit.
        _swap(e.tensor, "meta")
        e.status = "meta" if not e.rewrite else "done"
    run.live = [e for e in run.live if e.written]
