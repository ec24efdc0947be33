"""What ZeRO3's meta-build initialisation does to one tensor: materialise it on the CPU when the
initialiser first uses it (a ``TorchFunctionMode``), watch the writes to it and refuse reads it must
not see (a ``TorchDispatchMode``), and finish it (this rank's elements to its slices, or the whole
tensor to the device). Shared by the per-module units (``_init``) and the whole-model initialiser
(``_init_whole``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Calls that read only a tensor's metadata: a meta tensor answers them without being materialised.
_METADATA = frozenset({"size", "dim", "numel", "shape", "dtype", "device", "requires_grad", "is_floating_point",
                       "element_size", "stride", "ndim", "ndimension", "nelement", "is_complex", "layout",
                       "is_contiguous", "__len__", "__hash__", "names", "is_meta", "is_sparse", "grad"})
# Ops that overwrite every element without reading the old ones: the only first use a unit may
# make of a tensor an earlier unit finished (and this rank no longer holds whole).
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
                         "geometric_", "log_normal_", "cauchy_"})
# aten ops that take a tensor for its shape, dtype or memory alone (views, *_like): they read no values.
_NO_VALUES = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                        "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "view", "_unsafe_view",
                        "reshape", "alias", "detach", "as_strided", "t", "transpose", "permute", "expand", "slice",
                        "select", "unsqueeze", "squeeze", "narrow", "split", "split_with_sizes", "chunk", "unbind",
                        "view_as_real", "view_as_complex", "_reshape_alias", "lift_fresh", "flatten", "unflatten"})


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
    unset: bool = False  # materialised for a whole-model initialiser: its first use must overwrite it


def call_name(func) -> str:
    """The name of what a ``TorchFunctionMode`` is asked to run (a property's, for its ``__get__``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


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
        if (e.rewrite or e.unset) and e.tensor.is_floating_point():
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
        if call_name(func) not in _METADATA:
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
        op = func._schema.name.split("::")[-1]
        if (e.rewrite or e.unset) and not e.written and not (writes and op in _OVERWRITES) and op not in _NO_VALUES:
            if e.unset:
                raise ValueError(f"ZeRO3 initialisation: {self.units.unit} reads {e.name!r} ({func._schema.name}) "
                                 f"before setting it: built on the meta device it has no values yet (a CPU "
                                 f"build's would be its constructor's); set it first (nn.init.*, .copy_(), .fill_())")
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
