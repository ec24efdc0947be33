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

A unit is what its initialiser touches: one that initialises its children too (torchtitan's
``init_weights`` calling its blocks') materialises them with it, so an initialiser that recurses
through the whole model makes the whole model one unit. Give ``init_fn`` one module's own tensors
at a time to keep a unit small.

Every tensor a unit should set is checked to have been written (an in-place op on its memory: the
``nn.init`` functions, ``copy_``, ``fill_``, ...); one that was not, or a module holding meta tensors
and no initialiser, is refused naming the tensor and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid.core import FlatShardPlan

_FIX = ("give ZeRO3(..., init_fn=fn), fn(module) initialising the module's own parameters and buffers in place "
        "(nn.init.*, .copy_(), .fill_(); it is called on every module holding tensors, as FSDP's param_init_fn), "
        "or define reset_parameters() on {cls}")
# Calls that read only a tensor's metadata: a meta tensor answers them without being materialised.
_METADATA = frozenset({"size", "dim", "numel", "shape", "dtype", "device", "requires_grad", "is_floating_point",
                       "element_size", "stride", "ndim", "ndimension", "nelement", "is_complex", "layout",
                       "is_contiguous", "__len__", "__hash__", "names", "is_meta", "is_sparse", "grad"})
# Ops that overwrite every element without reading the old ones: the only first use a unit may
# make of a tensor an earlier unit finished (and this rank no longer holds whole).
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
                         "geometric_", "log_normal_", "cauchy_"})


@dataclasses.dataclass(eq=False)
class _Entry:
    """One meta tensor of the model: its name, whether ZeRO3 shards it (its spec index), and where
    it stands: "meta" (not yet materialised), "live" (materialised in this unit), "done"."""

    name: str
    tensor: torch.Tensor
    spec: int | None
    status: str = "meta"
    rewrite: bool = False  # live again after "done": its first use must overwrite it
    written: bool = False


def is_meta_module(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _swap(t: torch.Tensor, device: torch.device | str) -> None:
    """Give ``t`` (the same Python object: modules and ZeRO3 keep it) uninitialised memory on
    ``device`` (or the meta device)."""
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, new)


class _Units(TorchFunctionMode):
    """While a unit's initialiser runs: materialises a meta tensor of the model on its first
    non-metadata use, refuses to let a finished tensor be read, and (its inner dispatch mode)
    records which tensors were written."""

    def __init__(self, entries: dict[int, _Entry], unit: str):
        super().__init__()
        self.entries, self.unit = entries, unit
        self.live: list[_Entry] = []
        self.by_storage: dict[int, _Entry] = {}

    def materialise(self, e: _Entry) -> None:
        e.rewrite, e.written = e.status == "done", False
        _swap(e.tensor, "cpu")
        if e.rewrite and e.tensor.is_floating_point():
            with torch.no_grad():
                e.tensor.fill_(float("nan"))  # were a read of it to slip through, it would show
        e.status = "live"
        self.live.append(e)
        if e.tensor.numel():
            self.by_storage[e.tensor.untyped_storage().data_ptr()] = e
        else:
            e.written = True  # nothing to write

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            for t in tree_flatten((args, kwargs))[0]:
                e = self.entries.get(id(t)) if isinstance(t, torch.Tensor) else None
                if e is not None and e.status != "live" and e.tensor.is_meta:
                    self.materialise(e)
        return func(*args, **kwargs)


class _Writes(TorchDispatchMode):
    """Marks the unit's live tensors an op writes; refuses a read of one an earlier unit finished."""

    def __init__(self, units: _Units):
        super().__init__()
        self.units = units

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.units.by_storage:
            schema = func._schema.arguments
            values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
            for a, arg in zip(schema, values):
                for v in (arg if isinstance(arg, (list, tuple)) else [arg]):
                    self._see(func, a, v)
        return func(*args, **kwargs)

    def _see(self, func, a, v) -> None:
        if not isinstance(v, torch.Tensor) or v.device.type == "meta" or not v.numel():
            return
        e = self.units.by_storage.get(v.untyped_storage().data_ptr())
        if e is None:
            return
        writes = a.alias_info is not None and a.alias_info.is_write
        if e.rewrite and not e.written and not (writes and func._schema.name.split("::")[-1] in _OVERWRITES):
            raise ValueError(f"ZeRO3 initialisation: {self.units.unit}'s initialiser uses {e.name!r} "
                             f"({func._schema.name}), which an earlier unit initialised and this rank now holds "
                             f"only a slice of: a unit may overwrite a tensor of another (a tied weight) but not "
                             f"read it; initialise each tensor from its own module")
        e.written |= writes


def _tensors(module: nn.Module, spec_of: dict[int, int]) -> tuple[dict[int, _Entry], list[tuple[nn.Module, list]]]:
    """Every meta tensor of the model (by ``id``), and each module with the entries it holds."""
    entries: dict[int, _Entry] = {}
    units = []
    for prefix, m in module.named_modules():
        held = []
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(m, kind).items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in entries:
                    entries[id(t)] = _Entry(f"{prefix}.{attr}" if prefix else attr, t, spec_of.get(id(t)))
                held.append((kind, attr, entries[id(t)]))
        if held:
            units.append((m, prefix, held))
    return entries, units


def _describe(prefix: str, m: nn.Module) -> str:
    return f"module {prefix!r} ({type(m).__name__})" if prefix else f"the root module ({type(m).__name__})"


def materialise(module: nn.Module, params: list[nn.Parameter], shards: FlatShardPlan, rank: int, *,
                init_fn: Callable[[nn.Module], None] | None, device: torch.device, group) -> list[torch.Tensor]:
    """Initialise the meta module unit by unit; returns this rank's slice of every bucket of
    ``shards`` (``params``: the sharded parameters, indexed as its specs). Buffers and parameters
    left unsharded end materialised on ``device``; the sharded ones stay meta (ZeRO3 makes them
    stand-ins). A collective (rank 0's RNG state is broadcast)."""
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable taking a module, got {init_fn!r}")
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


@torch.no_grad()
def _finish(e: _Entry, slices: list[torch.Tensor], pieces: dict[int, list], device: torch.device) -> None:
    """A unit's tensor is set: this rank's elements of a sharded one go to its slices (its memory
    is dropped); a buffer or frozen parameter moves to ``device``, whole."""
    if e.spec is None:
        if e.tensor.device != device:
            moved = e.tensor.to(device)
            torch.utils.swap_tensors(e.tensor, nn.Parameter(moved, requires_grad=e.tensor.requires_grad)
                                     if isinstance(e.tensor, nn.Parameter) else moved)
    else:
        flat = e.tensor.detach().reshape(-1)
        for b, start, stop, offset in pieces.get(e.spec, ()):
            slices[b][offset:offset + stop - start].copy_(flat[start:stop])
        _swap(e.tensor, "meta")
    e.status = "done"


def _use_rank0_rng(group) -> None:
    """Every rank draws from rank 0's CPU RNG state (DDP's construction takes rank 0's values)."""
    if dist.get_world_size(group) == 1:
        return
    state = torch.get_rng_state()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(state, src=src, group=group)
    torch.set_rng_state(state)
