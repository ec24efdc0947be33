"""ZeRO3 on a meta-built module with the model's own whole-model initialiser, called once on the
root as torchtitan calls it (``init_fn=model.init_weights``, ``init_weights(buffer_device=None)``,
or any callable that takes no arguments): every rank runs that one call for real, on the CPU,
under rank 0's RNG state, while each sharded parameter exists in full only while the initialiser
is using it.

How: the initialiser runs under the materialising mode of ``_init_tensors``. A sharded parameter is
materialised (NaN-filled, its first use must overwrite it) when a call first uses it, and finished
(this rank's elements copied to its slices, the full tensor dropped) as soon as a call uses another
sharded parameter and nothing else still refers to its memory (no view or ``.data`` alias alive).
A parameter used again after that comes back: without its values if the call overwrites it whole
(``normal_``, ``copy_``, ... on the tensor itself: a tied weight initialised twice), else gathered
from every rank's slices (a collective; every rank runs the same calls on the same values, so all
ranks take it at the same point). So the values are bit for bit those of the same call on a CPU
build under the same RNG state, whatever the order of the initialiser's uses, and a rank holds at
once its slices, the buffers, and the parameters the initialiser is using.

Buffers are materialised on the CPU before the call (whole, as every rank keeps them), so that an
initialiser placing new ones by an old one's device (torchtitan's ``buffer_device or
self.freqs_cis.device``) computes them on the CPU, as a CPU build does; a buffer it assigns anew
(``self.freqs_cis = ...``) is taken as it is. Every meta tensor must be set by the call; one that is
not, or one read before it is set, is refused by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from hybrid.core import FlatShardPlan
from hybrid.torch.zero.zero3._init_tensors import (_METADATA, _Entry, _Units, _Writes, _describe, _finish, _swap,
                                                    _use_rank0_rng, call_name)

# Metadata a CPU build answers otherwise than the meta device: asking it is a use (materialises the
# tensor), as nn.init.trunc_normal_ does nothing to a tensor that answers is_meta.
_DEVICE_QUERIES = frozenset({"is_meta", "device"})
_NO_USE = _METADATA - _DEVICE_QUERIES
# nn.init functions and tensor methods that set every element of the tensor they are called on
# without reading it: a finished parameter they are called on comes back without its values.
_WHOLE_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "zeros_", "ones_", "constant_",
                               "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                               "trunc_normal_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
                               "geometric_"})


def is_whole_model_initialiser(init_fn: Callable) -> bool:
    """Whether ``init_fn`` initialises the whole model in one call: it can be called with no
    arguments (torchtitan's ``model.init_weights``, ``init_weights(buffer_device=None)``, a lambda or
    ``functools.partial`` of it). A callable that needs one argument is a per-module ``init_fn(module)``.

    >>> is_whole_model_initialiser(lambda buffer_device=None: None), is_whole_model_initialiser(lambda module: None)
    (True, False)
    """
    try:
        inspect.signature(init_fn).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): the documented per-module form
        return False
    return True


class _WholeModel(_Units):
    """The materialising mode for one whole-model call: parameters come and go as it uses them."""

    def __init__(self, entries: dict[int, _Entry], unit: str, back: Callable[[_Entry, bool], None],
                 finish: Callable[[_Entry], None]):
        super().__init__(entries, unit)
        self.back, self.finish = back, finish

    def release(self, e: _Entry) -> None:
        """``e`` is finished (or replaced): no longer live here."""
        self.live.remove(e)
        if e.tensor.numel():
            self.by_storage.pop(e.tensor.untyped_storage().data_ptr(), None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = call_name(func)
        if name not in _NO_USE:
            used = []
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    e = self.entries.get(id(t))
                    if e is None and not t.is_meta and t.numel():
                        e = self.by_storage.get(t.untyped_storage().data_ptr())  # a view or alias of a live one
                    if e is not None and e not in used:
                        used.append(e)
            if any(e.spec is not None for e in used):
                for e in [e for e in self.live if e.spec is not None and e not in used and not _aliased(e.tensor)]:
                    self.finish(e)
            # What the call writes: a method's self, or nn.init's tensor= (handle_torch_function's keyword).
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            for e in used:
                if e.tensor.is_meta:
                    self.back(e, name in _WHOLE_OVERWRITES and target is e.tensor)
        return func(*args, **kwargs)


def _aliased(t: torch.Tensor) -> bool:
    """Whether a view or ``.data`` alias of ``t`` is alive (its memory would outlive the finish)."""
    # 2: the tensor itself and the storage object this call makes.
    return t.numel() > 0 and torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


class _Gatherer:
    """Brings a finished parameter back whole from every rank's slices (a collective)."""

    def __init__(self, shards: FlatShardPlan, rank: int, slices: list[torch.Tensor], group):
        self.shards, self.rank, self.slices, self.group = shards, rank, slices, group
        self.world_size = dist.get_world_size(group)
        self._pieces: dict[int, list[list[tuple]]] | None = None

    def pieces(self, spec: int) -> list[list[tuple]]:
        """Per rank, ``(bucket, start, stop, shard_offset)`` of tensor ``spec``'s elements it holds."""
        if self._pieces is None:
            self._pieces = {}
            for b in range(self.shards.bucket_plan.num_buckets):
                for r in range(self.world_size):
                    for s in self.shards.member_slices(b, r):
                        per_rank = self._pieces.setdefault(s.tensor, [[] for _ in range(self.world_size)])
                        per_rank[r].append((b, s.start, s.stop, s.shard_offset))
        return self._pieces.get(spec, [[] for _ in range(self.world_size)])

    @torch.no_grad()
    def gather(self, e: _Entry) -> None:
        flat = e.tensor.view(-1)
        per_rank = self.pieces(e.spec)
        mine = [self.slices[b][o:o + stop - start] for b, start, stop, o in per_rank[self.rank]]
        if self.world_size == 1:
            for (b, start, stop, o), piece in zip(per_rank[0], mine):
                flat[start:stop].copy_(piece)
            return
        longest = max(sum(stop - start for _, start, stop, _ in p) for p in per_rank)
        out = torch.zeros(longest, dtype=flat.dtype, device=self.slices[0].device if self.slices else "cpu")
        if mine:
            torch.cat(mine, out=out[:sum(m.numel() for m in mine)])
        gathered = [torch.empty_like(out) for _ in range(self.world_size)]
        dist.all_gather(gathered, out, group=self.group)
        for r, p in enumerate(per_rank):
            at = 0
            for _, start, stop, _ in p:
                flat[start:stop].copy_(gathered[r][at:at + stop - start])
                at += stop - start


def initialise_whole_model(module: nn.Module, init_fn: Callable[[], object], entries: dict[int, _Entry],
                           units: list, slices: list[torch.Tensor], pieces: dict[int, list], *,
                           shards: FlatShardPlan, rank: int, device: torch.device, group) -> None:
    """Run ``init_fn()`` once over the meta ``module`` (see the module docstring), filling
    ``slices``. ``entries`` and ``units``: every meta tensor, and each module with the tensors it
    holds (``_tensors``); ``pieces``: this rank's pieces of each sharded tensor. A collective."""
    root = _describe("", module)
    gatherer = _Gatherer(shards, rank, slices, group)
    run: _WholeModel

    def back(e: _Entry, overwritten: bool) -> None:
        was_done = e.status == "done"
        e.unset = not was_done or overwritten
        run.materialise(e)
        e.rewrite = False  # its guard is e.unset's
        if was_done and not overwritten:
            gatherer.gather(e)
            e.unset, e.written = False, True

    def finish(e: _Entry) -> None:
        run.release(e)
        _finish(e, slices, pieces, device)

    run = _WholeModel(entries, f"{root}'s whole-model initialiser", back, finish)
    for e in entries.values():
        if e.spec is None and not isinstance(e.tensor, nn.Parameter):
            e.unset = True
            run.materialise(e)  # buffers first, whole: an initialiser may place new ones by their device
    _use_rank0_rng(group)
    with run, _Writes(run):
        init_fn()
    for m, prefix, held in units:
        for kind, attr, e in held:
            now = getattr(m, kind).get(attr)
            if now is e.tensor:
                continue
            if kind == "_buffers" and isinstance(now, torch.Tensor) and not now.is_meta:
                if e.status == "live":  # assigned anew: the module holds the new one
                    run.release(e)
                _swap(e.tensor, "meta")
                e.tensor, e.written, e.status = now, True, "live"
                run.live.append(e)
                continue
            raise ValueError(f"ZeRO3 initialisation: {root}'s whole-model initialiser replaced {e.name!r} with "
                             f"{'a meta tensor' if isinstance(now, torch.Tensor) else 'another object'}; initialise "
                             f"parameters in place (nn.init.*, .copy_(), .fill_()): ZeRO3 shards the object the "
                             f"module was built with, and a new buffer must hold values (not on the meta device)")
    unset = [e.name for e in entries.values() if not e.written]
    if unset:
        raise ValueError(f"ZeRO3: {unset[:3]} {'is' if len(unset) == 1 else 'are'} on the meta device and "
                         f"{root}'s whole-model initialiser init_fn() did not set {'it' if len(unset) == 1 else 'them'}"
                         f"{f' (and {len(unset) - 3} more)' if len(unset) > 3 else ''}: it must set every parameter "
                         f"and buffer in place, as on a model built with to_empty()")
    for e in list(run.live):
        run.live.remove(e)
        _finish(e, slices, pieces, device)
