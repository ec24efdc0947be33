"""ZeRO-3 for torch: ``hybrid.torch.ZeRO3``, a module wrapper whose parameters live sharded.

Each rank keeps only its flat slice of every bucket of the plan (:func:`hybrid.core.shard_flat`,
the layout of ZeRO2's gradient slices and of checkpoint files); a bucket is gathered while its
parameters are used and freed after (``_schedule``), gradients are reduced per bucket into
this rank's slice (``_grads``), and :class:`~hybrid.torch.ZeRO3Optimizer` steps the slices.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._pytree import tree_map

from hybrid.core import (BucketPlan, FlatShardPlan, TensorSpec, canonical_dtype, shard_flat, zero3_group_plan,
                         zero3_plan)
from hybrid.torch._call_guard import CallGuard
from hybrid.torch.ddp._parts import _reduced_parameters
from hybrid.torch.zero.zero3._grads import GradReducer
from hybrid.torch.zero.zero3._init import is_meta_module, materialise
from hybrid.torch.zero.zero3._params import ParamBuckets, WorkingSet
from hybrid.torch.zero.zero3._schedule import Schedule
from hybrid.torch.zero.zero3._shards import ParameterInShards
from hybrid.torch.zero.zero3._state import declared_external as _declared
from hybrid.torch.zero.zero3._state import full_state_dict, load_state_dict

__all__ = ["ZeRO3"]

MiB = 1 << 20
POLICIES = ("speed", "memory")


def _owners(module: nn.Module, index_of: dict[int, int]) -> list[int]:
    """Per sharded parameter, the first module (in ``modules()`` order) holding it: its group."""
    owner = {}
    for k, m in enumerate(module.modules()):
        for p in m._parameters.values():
            if p is not None and id(p) in index_of:
                owner.setdefault(index_of[id(p)], k)
    return [owner[i] for i in range(len(index_of))]


def _weakly(obj: Any, method: str) -> Callable:
    """``obj.method`` through a weak reference: the parts a ZeRO3 model builds call back into it
    without keeping it alive (a cycle would keep a dropped model, and its memory, until the garbage
    collector runs). Once it is gone the call returns None."""
    ref = weakref.ref(obj)

    def call(*args):
        alive = ref()
        return None if alive is None else getattr(alive, method)(*args)
    return call


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _begin_forward_seen(model: "ZeRO3", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # dynamo's callback is still set in this (skipped) frame when the whole model runs compiled;
    # everything below it runs eagerly (a disabled function), not as frames of their own.
    callback = get_eval_frame_callback()
    return model._begin_forward_eagerly(args, kwargs, callback is not None and callback is not False)


# dynamo skips this frame, not the frames it calls (as hybrid.torch.dynamo's forward_module): a
# traced ZeRO3.forward graph-breaks here, and the frame sees whether a compile is running.
_begin_forward = torch._dynamo.decorators.skip(_begin_forward_seen)


class ZeRO3(nn.Module):
    """``module`` with its parameters sharded over the ranks: ZeRO stage 3 (FSDP's full sharding).

    Like DDP, every rank runs the whole model on its own inputs, and gradients are averaged over
    the ranks. Unlike DDP, a rank keeps only ``1 / world_size`` of every bucket of parameters,
    gradients and (with :class:`~hybrid.torch.ZeRO3Optimizer`) optimizer state. A bucket's
    parameters are gathered just before the first module that needs them runs (the next
    ``prefetch`` buckets in forward order are gathered meanwhile) and freed once every module
    needing them has run; the backward gathers them again in reverse order (or finds them kept:
    ``reshard_after_forward=False``), reduces each bucket's gradients once they are all ready,
    keeps this rank's slice and frees the rest. Construction takes rank 0's parameter and buffer
    values, as DDP does; a module built on the meta device is initialised instead, one module at a
    time, each rank keeping its slices only (``init_fn``).

    Between uses the model's parameters are :class:`ParameterInShards` stand-ins (right shape,
    dtype and device; reading their values outside a forward raises, naming the parameter): read
    them inside ``with model.gathered():``. While a forward runs, a parameter read anywhere (a
    parent's forward, a sibling, a functional op) computes with its gathered values. Every
    collective call (a forward, a backward, ``state_dict()``, ``gathered()``) first checks that
    every rank is making it, and raises on every rank, naming both calls, if not.
    ``.grad`` after ``backward()`` holds a :class:`~hybrid.torch.GradientInShards` stand-in (the
    gradient is in the slices); step with :class:`~hybrid.torch.ZeRO3Optimizer`, clip with its
    ``clip_grad_norm_``.

    Args:
      module: the model; its parameters requiring gradients are sharded, the others and its
        buffers stay whole on every rank.
      process_group: the ranks to shard over (default: the world).
      bucket_cap_mb: the plan's bucket cap (a bucket is the unit of gathering and of reduction);
        default :func:`hybrid.core.zero3_bucket_cap`: a 16th of the parameters' bytes, within
        1 and 25 MiB. The plan is :func:`hybrid.core.zero3_plan` (a module's parameters share
        a bucket; bucket 0, the last layers, capped at ``min(1, cap)`` MiB as in DDP). Smaller
        buckets hold less gathered at a time and cost more collectives.
      prefetch: how many buckets ahead to gather while a bucket computes (>= 0).
      reshard_after_forward: free buckets after the forward and gather them again in the
        backward (True, FSDP's default), or keep them from the forward to the backward.
      mp_policy: mixed precision: an object with torch FSDP2's ``MixedPrecisionPolicy`` fields
        (``param_dtype``: the gathered parameters' dtype; ``reduce_dtype``: the gradients'
        reduction dtype, default ``param_dtype``; ``output_dtype``; ``cast_forward_inputs``).
        The slices, the gradient slices and the optimizer state stay in float32.
      init_fn: for a module built on the meta device (``with torch.device("meta"): model = Net()``):
        ``init_fn(module)`` initialises a module's own parameters and buffers in place; it is
        called on every module holding tensors, in ``module.modules()`` order, one module
        materialised at a time (default: the module's ``reset_parameters()``). An ``init_fn``
        taking no arguments initialises the whole model in one call, as torchtitan calls
        ``model.init_weights()`` (``init_fn=model.init_weights``, ``buffer_device=`` too): each
        parameter is materialised only while it uses it. Each rank keeps only its slices; the
        values are bit for bit those of the same calls on a CPU build under rank 0's RNG state.
        See ``hybrid.torch.zero.zero3._init`` and ``_init_whole``.
      device: where a meta-built model's slices, buffers and gathered buckets live (default CPU).
      policy: ``"speed"`` (the default): the plan above, fewer and larger buckets, the forward's
        last bucket kept for the backward. ``"memory"``: a bucket per module (its own
        parameters: FSDP2's unit when ``fully_shard`` wraps every layer, whatever its size) and
        nothing kept between the forward and the backward, so a rank holds at most a module or
        two gathered; a collective per module, which costs step time where modules are small
        (docs/zero3-memory.md, "Memory or speed").
      external_params: ``{module: [parameters]}``: parameters of other modules that ``module``'s
        forward reads, gathered with its own (DeepSpeed's ``register_external_parameter``).
        Needed only for speed: a read outside the parameter's own module is seen where it
        happens and gathered there (blocking, no prefetch).

    >>> import torch, torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> model = ZeRO3(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), bucket_cap_mb=1e-4)
    >>> model.bucket_plan.num_buckets, model.forward_order  # buckets by first use in the forward
    (2, (1, 0))
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> model.module[0].weight.grad
    GradientInShards('0.weight', shape=(8, 4))
    >>> with model.gathered():
    ...     model.module[1].bias.tolist() == model.state_dict()["module.1.bias"].tolist()
    True
    >>> dist.destroy_process_group()
    """

    def __init__(self, module: nn.Module, *, process_group=None, bucket_cap_mb: float | None = None,
                 prefetch: int = 1, reshard_after_forward: bool = True, mp_policy: Any = None,
                 init_fn: Callable[[nn.Module], None] | None = None, device: torch.device | str | None = None,
                 external_params: Mapping[nn.Module, Iterable[nn.Parameter]] | None = None, policy: str = "speed"):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ZeRO3 wraps a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (buckets gathered ahead), got {prefetch!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "memory" and bucket_cap_mb is not None:
            raise ValueError("ZeRO3: policy='memory' makes a bucket of each module's parameters, whatever their "
                             "size; give it or bucket_cap_mb=, not both")
        meta = is_meta_module(module)
        if not meta and (init_fn is not None or device is not None):
            raise ValueError("ZeRO3: init_fn= and device= are for a module built on the meta device (with "
                             "torch.device('meta'): ...); this one has its values already")
        if meta and init_fn is None and callable(getattr(module, "init_weights", None)):
            # The model's own initialisation never ran on the meta device; torch's layers' defaults will.
            warnings.warn(f"ZeRO3: {type(module).__name__} defines init_weights(), but a module built on the meta "
                          f"device is initialised by each module's reset_parameters() (torch's defaults) unless "
                          f"ZeRO3 is given init_fn=: pass init_fn=model.init_weights (called once if it takes no "
                          f"argument, per module if it takes one), or a function that initialises one module's "
                          f"own tensors", stacklevel=2)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        first = next(iter(module.parameters()), None)
        where = torch.device("cpu" if meta or first is None else first.device) if device is None else torch.device(device)
        self._guard = CallGuard(process_group, "ZeRO3", where)
        self._guard.enter("construction")
        self.prefetch, self.reshard_after_forward = prefetch, bool(reshard_after_forward)
        self._mp = mp_policy
        param_dtype = getattr(mp_policy, "param_dtype", None)
        reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or param_dtype
        named = _reduced_parameters(module)
        if not named:
            raise ValueError("ZeRO3: the module has no parameter that requires a gradient")
        for name, p in named:
            if p.is_sparse or not p.is_floating_point():
                raise ValueError(f"ZeRO3 shards dense floating-point parameters; {name!r} is {p.dtype}"
                                 f"{' (sparse)' if p.is_sparse else ''}")
        self._names = [n for n, _ in named]
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        declared = _declared(module, external_params, self._index_of)
        # Names and dtypes as saved (device-less): the plan is the checkpoint's plan too.
        specs = [TensorSpec(n, tuple(p.shape), canonical_dtype(p.dtype)) for n, p in named]
        self.policy = policy
        if policy == "memory":
            self.bucket_plan: BucketPlan = zero3_group_plan(specs, _owners(module, self._index_of))
        else:
            self.bucket_plan = zero3_plan(
                specs, bucket_cap_bytes=None if bucket_cap_mb is None else int(bucket_cap_mb * MiB))
        self.shards: FlatShardPlan = shard_flat(self.bucket_plan, self.world_size)
        slices = None
        if meta:
            slices = materialise(module, self._params, self.shards, self.rank, init_fn=init_fn, device=where,
                                 group=process_group)
        # gloo's reduce-scatter and all-gather are slower than its all-reduce and broadcasts (see ZeRO2).
        flat = dist.get_backend(process_group) != dist.Backend.GLOO
        self._working = WorkingSet()
        self._buckets = ParamBuckets(self._params, self.shards, self.rank, group=process_group,
                                     compute_dtype=param_dtype, flat_collectives=flat, working=self._working,
                                     slices=slices, device=where if meta else None)
        for i, (p, name) in enumerate(zip(self._params, self._names)):
            # Its values now live in the slices; a read while a forward runs computes with them.
            ParameterInShards.convert(p, name, functools.partial(_weakly(self, "_read"), i),
                                      device=where if meta else None)
        self._grads = GradReducer(self._buckets.work, self._names, self._params, self.shards, self.rank,
                                  group=process_group, reduce_dtype=reduce_dtype, flat_collectives=flat,
                                  on_bucket_done=_weakly(self, "_bucket_done"), working=self._working,
                                  guard=self._guard)
        self._schedule = Schedule(module, self.bucket_plan, self._index_of, self._buckets, self._grads,
                                  prefetch=prefetch, reshard_after_forward=self.reshard_after_forward,
                                  declared=declared, on_implicit_forward=_weakly(self, "_begin_implicit_forward"),
                                  keep_for_backward=policy == "speed")
        self._sync_buffers()

    def _read(self, i: int):
        return self._schedule.working(i)

    def _bucket_done(self, b: int) -> None:
        self._schedule.bucket_done(b)

    def _begin_implicit_forward(self) -> None:
        """A module of the model was called outside ``model(x)`` (``model.module(x)``): the same
        gathers, so the same check that every rank makes the call."""
        self._guard.enter("forward (the inner module called directly)")
        self._grads.abandon_unfinished()
        self._grads.drop_stand_ins()

    def _sync_buffers(self) -> None:
        """Rank 0's buffers (and parameters left unsharded) everywhere, as DDP's construction does."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        rest = [t for t in self.module.buffers()] + [p for p in self.module.parameters()
                                                      if id(p) not in self._index_of]
        with torch.no_grad():
            for t in rest:
                dist.broadcast(t.data, src=src, group=self.process_group)

    @property
    def forward_order(self) -> tuple[int, ...]:
        """Bucket indices in the order the forward first uses them (observed in the latest
        forward; before any, the plan's reverse). The backward gathers in the reverse order."""
        return self._schedule.order

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Under torch.compile the bookkeeping runs as graph breaks (_begin_forward, _end_forward,
        # the units' hooks); dynamo traces the module between them.
        args, kwargs = _begin_forward(self, args, kwargs)
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            # A module that raised left its working parameters in place and its buckets gathered.
            self._schedule.abort_forward()
            raise
        return self._end_forward(out)

    @torch._dynamo.disable
    def _begin_forward_eagerly(self, args: tuple, kwargs: dict, whole_compiled: bool) -> tuple[tuple, dict]:
        self._guard.enter("forward")
        self._grads.abandon_unfinished()
        self._grads.drop_stand_ins()
        if whole_compiled:
            # Once compiled whole, the blocks stay the units, eager calls included: hooks changing
            # back and forth would make dynamo recompile at every switch.
            self._schedule.hook_units(whole_compiled=True)
        if getattr(self._mp, "cast_forward_inputs", False):
            args, kwargs = _cast((args, kwargs), getattr(self._mp, "param_dtype", None))
        self._schedule.begin_forward()
        return args, kwargs

    @torch._dynamo.disable
    def _end_forward(self, out: Any) -> Any:
        out = self._schedule.end_forward(out)
        return _cast(out, getattr(self._mp, "output_dtype", None))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients local and whole, in ``.grad`` (as DDP's
        ``no_sync``: a full gradient per rank); the first backward outside reduces their sum."""
        old, self._grads.sync = self._grads.sync, False
        try:
            yield
        finally:
            self._grads.sync = old

    @contextlib.contextmanager
    def gathered(self, *, writeback: bool = False) -> Iterator[None]:
        """Every parameter whole inside the block (the full model on every rank: a collective).

        The parameters stay the stand-in objects, each read computing with the gathered values, so
        a reference taken inside is a stand-in again after the block; views taken inside (a
        ``detach()``, a ``.numpy()``) keep their memory. ``model.module(x)`` and ``model(x)`` run
        on the gathered parameters without gathering again. With ``writeback=True`` changes made
        to the parameters inside are kept (each rank keeps its slice of the values it holds at
        the end; make them agree across ranks).
        """
        self._guard.enter("gathered()")
        for b in range(self._buckets.num_buckets):
            self._buckets.gather(b, "gathered()")
        try:
            for b in range(self._buckets.num_buckets):
                self._buckets.wait(b)
        except BaseException:
            self._buckets.free_all(quiet=True)
            raise
        self._schedule.pin()
        try:
            yield
            if writeback:
                for b in range(self._buckets.num_buckets):
                    self._buckets.write_back(b)
        except BaseException:
            self._schedule.unpin(quiet=True)  # the error in flight is the one to report
            raise
        self._schedule.unpin()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """torch's ``state_dict``, every parameter whole (keys ``module.*``, as DDP's); gathered
        bucket by bucket, so it is a collective: call it on every rank (to save on rank 0 only,
        call it everywhere and save on rank 0, or use :meth:`full_state_dict`)."""
        if args or kwargs.get("keep_vars") or kwargs.get("destination") is not None:
            raise TypeError("ZeRO3.state_dict takes only prefix=; the parameters are copies gathered from the ranks")
        self._guard.enter("state_dict()")
        return full_state_dict(self, prefix=kwargs.get("prefix", ""), to_rank0=False)

    def full_state_dict(self, *, prefix: str = "") -> dict[str, Any]:
        """:meth:`state_dict` gathered to rank 0 only: rank 0 gets the whole dict (one bucket of
        the other ranks' slices in flight at a time), every other rank an empty one and no memory
        beyond its slices. A collective: call it on every rank, save on rank 0 (the DDP habit
        ``if rank == 0: torch.save(model.state_dict(), f)`` made right, as torch's
        ``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``)."""
        self._guard.enter("full_state_dict()")
        return full_state_dict(self, prefix=prefix, to_rank0=True)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict`` (keys ``module.*``): each rank copies its slice of each
        parameter, at full precision, straight from ``state_dict`` (nothing is gathered, no rank
        holds the model whole beyond the dict it was given), and the buffers; torch's key and
        shape checks come first, and nothing changes if they fail."""
        if assign:
            raise ValueError("ZeRO3.load_state_dict: assign=True would replace the sharded parameters")
        return load_state_dict(self, state_dict, strict=strict)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: ``param_slices``, ``grad_slices``; and ``working_set``, the
        most bytes of full buckets (parameters gathered, gradients being reduced) alive at once
        since the last :meth:`reset_peak_memory_stats` (see :func:`hybrid.core.zero3_memory`)."""
        return {"param_slices": sum(s.numel() * s.element_size() for s in self._buckets.slices),
                "grad_slices": sum(g.numel() * g.element_size() for g in self._grads.slices if g is not None),
                "working_set": self._working.peak}

    def reset_peak_memory_stats(self) -> None:
        self._working.reset_peak()
