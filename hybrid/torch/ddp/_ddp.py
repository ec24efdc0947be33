"""A drop-in ``torch.nn.parallel.DistributedDataParallel`` whose buckets come from hybrid.core.

The layout (bucket membership, offsets, rebuild) is decided by ``hybrid.core``; the per-iteration
bookkeeping is ``hybrid.core._reducer_state``; this module only moves tensors and issues
``torch.distributed`` collectives.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.distributed import _BufferCommHookLocation

from hybrid.core import ddp_size_limits
from hybrid.torch.ddp._parts import GradBucket, specs  # noqa: F401 - re-exported by hybrid.torch
from hybrid.torch.ddp._parts import _reachable_params, _reduced_parameters
from hybrid.torch.ddp._parts import unfinished_reduction_message
from hybrid.torch._collectives import naming
from hybrid.torch.ddp._api import TorchMethods, process_group_for
from hybrid.torch.ddp._auto import AUTO
from hybrid.torch.ddp._buffers import BufferSync
from hybrid.torch.ddp._delay import DelayedAllReduce
from hybrid.torch.ddp._join import _JoinHook
from hybrid.torch.ddp._mixed import MixedPrecision, _allreduce_and_upcast_hook
from hybrid.torch.ddp._pickle import Pickling
from hybrid.torch.ddp._sink import through_sink
from hybrid.torch.ddp._sync import BROADCAST_BUCKET_BYTES, RankAgreement
from hybrid.torch.ddp._reducer import Reducer
from hybrid.torch.ddp import _forward  # torch.compile(ddp) splits graphs there (hybrid.torch.dynamo)

_MB = 1024 * 1024


def _check_auto(bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters, static_graph) -> bool:
    """Whether ``bucket_cap_mb`` asks for hybrid's auto plan; a clear error where it cannot apply."""
    if not isinstance(bucket_cap_mb, str):
        return False
    if bucket_cap_mb != AUTO:
        raise ValueError(f"bucket_cap_mb must be a number of MB or 'auto', got {bucket_cap_mb!r}")
    if bucket_cap_mb_list:
        raise ValueError(f"bucket_cap_mb='auto' plans every bucket itself; it cannot be combined with "
                         f"bucket_cap_mb_list={bucket_cap_mb_list!r}")
    if find_unused_parameters and not static_graph:
        raise ValueError("bucket_cap_mb='auto' plans from the gradients' order and times in the first iteration, "
                         "which DDP rebuilds its buckets from only without find_unused_parameters=True (or with "
                         "static_graph=True); drop one of them")
    return True


def _cap_bytes(mb: float) -> int:
    """A bucket cap in MB as bytes; a negative cap means unlimited, as in torch (its C++ reads
    the negative byte count as a huge unsigned size: one bucket per dtype and device)."""
    return sys.maxsize if mb < 0 else int(mb * _MB)


class DistributedDataParallel(Pickling, TorchMethods, Reducer, nn.Module, Joinable):
    """torch's ``DistributedDataParallel``, with buckets planned by ``hybrid.core``.

    Same constructor; ``bucket_plan`` is the :class:`~hybrid.core.BucketPlan` in use (the initial
    one-bucket-per-dtype plan, then the plan rebuilt from the first iteration's ready order).
    ``bucket_cap_mb="auto"`` (hybrid's, opt-in) rebuilds instead with the plan the process group's
    cost model says ends the backward's communication soonest (docs/torch.md).

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> ddp(torch.ones(3, 4)).sum().backward()
    >>> ddp.module.weight.grad.shape, ddp.bucket_plan.num_buckets
    (torch.Size([2, 4]), 1)
    >>> dist.destroy_process_group()
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        Joinable.__init__(self)
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                             "need to be set at the same time.")
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        self.process_group = process_group_for(process_group, device_mesh, module)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # The delayed parameters, chosen before the reduced ones: they join parameters_to_ignore.
        delayed = list(delay_all_reduce_named_params or ())
        self._delayed = DelayedAllReduce(delayed, param_to_hook_all_reduce) if delayed else None
        self.parameters_to_ignore.update(name for name, _ in delayed)
        named = _reduced_parameters(module, self.parameters_to_ignore)
        # torch's: no reducer, and the forward only runs the module
        self._delay_all_reduce_all_params = bool(delayed) and not named
        if not named and not delayed:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        # torch's: every parameter not ignored (frozen ones too) decides the device.
        module_params = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        device_types = {p.device.type for p in module_params}
        if len(device_types) != 1:
            raise ValueError("DistributedDataParallel's input module must be on the same type of devices, "
                             f"but input module parameters locate in {device_types}.")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        if next(iter(device_types)) == "cpu" and (device_ids or output_device):
            raise ValueError("DistributedDataParallel device_ids and output_device arguments only work "
                             "with single-device/multiple-device GPU modules or CPU modules, but got "
                             f"device_ids {device_ids}, output_device {output_device}, and module "
                             f"parameters { {p.device for p in module_params} }.")
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device if output_device is not None else (device_ids[0] if device_ids else None)
        self.module = module
        self.dim = dim
        self.device = module_params[0].device
        if broadcast_buffers is not None and forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=2)
        elif broadcast_buffers is not None:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                          "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` "
                          "still syncs buffers at init.", FutureWarning, stacklevel=2)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is None or bool(broadcast_buffers)
        self.broadcast_buffers = self.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        # The user promises the same unused parameters on every rank: the used map stays local.
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffer_sync = BufferSync(module, self.parameters_to_ignore)
        self._set_ranks()
        self._divide_by_initial_world_size = True
        self.batched_grad_copy = batched_grad_copy
        self._init_sync_buffers = init_sync_buffers

        # bucket_cap_mb="auto": hybrid's own, opt-in; torch's numbers keep torch's meaning.
        self._auto_caps = _check_auto(bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters, static_graph)
        if self._auto_caps:
            bucket_cap_mb = None  # the initial plan, and anything that asks for caps, gets torch's defaults
        # What decides the bucket layout, as the user spelled it: ranks must agree on it.
        self._layout_settings = {"bucket_cap_mb": AUTO if self._auto_caps else bucket_cap_mb,
                                 "bucket_cap_mb_list": bucket_cap_mb_list,
                                 "find_unused_parameters": bool(find_unused_parameters),
                                 "static_graph": bool(static_graph)}
        if bucket_cap_mb_list:
            caps = tuple(_cap_bytes(mb) for mb in bucket_cap_mb_list)
            self._initial_limits, self._rebuild_limits = ddp_size_limits(
                bucket_caps_bytes=caps, static_graph=static_graph, find_unused_parameters=find_unused_parameters)
        else:
            self._initial_limits, self._rebuild_limits = ddp_size_limits(
                bucket_cap_bytes=None if bucket_cap_mb is None else _cap_bytes(bucket_cap_mb),
                static_graph=static_graph, find_unused_parameters=find_unused_parameters)
        # Before planning: the buckets are laid out in the reduce dtype.
        self.mixed_precision = mixed_precision
        self._mixed = None if mixed_precision is None else MixedPrecision(
            mixed_precision, find_unused_parameters=find_unused_parameters)
        # Ranks compare these settings key by key: the key is there with or without a config.
        self._layout_settings["mixed_precision"] = None if self._mixed is None else self._mixed.layout_setting
        # gradient_as_bucket_view's aliasing: a full-precision .grad cannot view a bucket in
        # another dtype, so under mixed precision .grad is its own tensor (in torch too, the
        # upcast gives it its own storage; only memory differs).
        self._grads_in_buckets = gradient_as_bucket_view and self._mixed is None

        if self._delayed is not None:
            self._delayed.start(self.process_group, device_ids)
            if self._delay_all_reduce_all_params:
                return

        if init_sync:
            self._ranks.verify_same_model(self._names, self._params, self._layout_settings)
            self._init_sync_buffers = init_sync_buffers
            self._sync_module_states(0)

        self._init_reducer()
        if self._mixed is not None:  # after the reducer, as torch: casts, copies, its comm hook
            self._mixed.setup(module, group=self.process_group, buckets=self._buckets, names=self._names,
                              index_of=self._index_of)
            self.register_comm_hook(weakref.ref(self._mixed), _allreduce_and_upcast_hook)

    def _set_ranks(self) -> None:
        self._ranks = RankAgreement(self.process_group, self.device)
        self._set_div_factor(self._ranks.world)

    def _sync_module_states(self, src: int) -> None:
        """torch's _sync_module_states: parameters (and buffers) from ``src`` to every rank."""
        if self._ranks.world == 1:
            return
        tensors = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        if self._init_sync_buffers:
            tensors += [b.detach() for b in self._buffer_sync.buffers]
        if tensors:
            self._ranks.broadcast(tensors, src, f"DistributedDataParallel: the broadcast of rank {src}'s parameters "
                                  "and buffers")

    def _set_div_factor(self, n: int) -> None:
        self._div_factor, self._inv_div = n, 1.0 / n

    # ---- buffers (torch's names) -------------------------------------------------------------

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers DDP syncs, by name, as the module held them at the last sync (torch's)."""
        return self._buffer_sync.named

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """torch's name for the buffers DDP syncs."""
        return self._buffer_sync.buffers

    @property
    def buffer_hook(self):
        """The registered buffer comm hook (torch's attribute; absent until one is registered)."""
        if self._buffer_sync.hook is None:
            raise AttributeError("buffer_hook")  # nn.Module's __getattr__ words it as torch's
        return self._buffer_sync.hook

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=_BufferCommHookLocation.POST_FORWARD):
        """Run ``hook(state, named_buffers)`` on the module's buffers (a dict of name to tensor)
        instead of broadcasting them from rank 0, before or after the forward
        (``torch.nn.parallel.distributed._BufferCommHookLocation``). The hook may return a list of
        futures: they are waited for at the end of the backward."""
        self._buffer_sync.register_hook(state, hook, comm_hook_location)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0):
        """torch's default buffer sync, for buffer hooks that call it: ``bufs`` (default: the
        module's buffers) broadcast from ``authoritative_rank``."""
        bufs = self._buffer_sync.buffers if bufs is None else bufs
        dist._broadcast_coalesced(self.process_group, bufs, bucket_size or BROADCAST_BUCKET_BYTES, authoritative_rank)

    def _check_sync_bufs_pre_fwd(self) -> bool:
        """Whether this forward syncs the buffers before running the module (torch's rule)."""
        return self.will_sync_module_buffers() and self._buffer_sync.syncs_before_forward()

    def _check_sync_bufs_post_fwd(self) -> bool:
        """Whether this forward runs a POST_FORWARD buffer hook after the module (torch's rule)."""
        return self.will_sync_module_buffers() and self._buffer_sync.syncs_after_forward()

    def _sync_buffers(self, rank_cond: bool = True) -> None:
        futs = self._buffer_sync.sync(self._ranks, rank_cond=rank_cond, join_enabled=self._join_config.enable)
        if futs:
            self._install_post_backward_futures(futs)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self._delay_all_reduce_all_params:  # no reducer, no buffer sync (torch's)
            out = self.module(*inputs, **kwargs)
            self._delayed.after_forward()
            return out
        # Under torch.compile only the wrapped module is traced: the reducer's bookkeeping runs
        # eagerly (compiler.disable), so dynamo guards on none of its per-iteration state (the
        # iteration counter, the rebuild flag), which changed every step and recompiled each time.
        grad_sync = self._pre_forward()
        if self._mixed is not None:
            inputs, kwargs = self._mixed.pre_forward(inputs, kwargs, sync=self.require_backward_grad_sync)
        # Under torch.compile the module runs compiled in pieces split at the bucket boundaries
        # (hybrid/torch/dynamo/_compile.py, through ddp/_forward.py); eagerly self.module(*inputs, **kwargs).
        out = _forward.run_module(self, inputs, kwargs)
        if self._mixed is not None:
            self._mixed.post_forward()
        return self._post_forward(out, grad_sync)

    @torch.compiler.disable
    def _pre_forward(self) -> bool:
        # The order of collectives below is torch's _pre_forward's; a joined rank's _JoinHook
        # issues the matching ones in the same order.
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:
            self._log_runtime_stats()  # of the iterations before this one, as torch logs them
            self._iteration += 1  # torch's reducer counts the iteration here (prepare_for_forward)
            if self.logger.should_collect(self._iteration):
                self.logger.record("forward_start")
            self._ensure_prior_reduction_finished()
        work = Join.notify_join_context(self)
        if work is not None:
            with naming("DistributedDataParallel forward (Join): the all-reduce that counts the ranks still training"):
                work.wait()
            self._set_div_factor(self._ranks.world if self._divide_by_initial_world_size
                                 else int(work.result()[0].item()))
        if torch.is_grad_enabled():
            self._maybe_rebuild()
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers()
        if self._join_config.enable:
            self._ranks.backward_sync_flag(self.require_backward_grad_sync, joined=False)
        return grad_sync

    @torch.compiler.disable
    def _post_forward(self, out, grad_sync: bool):
        """The output as the caller gets it; with find_unused_parameters, through torch's sink."""
        # A POST_FORWARD buffer hook; decided, as torch, by the previous forward's sync flag.
        if self._check_sync_bufs_post_fwd():
            self._sync_buffers()
        # torch's: a forward without backward sync (no_sync(), no_grad) skips the next buffer sync.
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            if self.logger.should_collect(self._iteration):
                self.logger.record("backward_compute_start")
            if self._ready_clock is not None:
                self._ready_clock.reset()
            self._state = self._start_state
            self._delaying = self.static_graph and self._static_unused is None
            self._futures = []
            self._num_buckets_reduced = 0
            self._pending_unused = ()
            self._undefined_now = set()
            if self.find_unused_parameters and not self.static_graph:
                reach = _reachable_params(out)
                self._pending_unused = tuple(i for i, p in enumerate(self._params) if id(p) not in reach)
                self._note_unused(self._pending_unused)
            elif self.static_graph and self._static_unused is not None:
                self._pending_unused = self._static_unused  # found in the first iteration
            self._expect_hooks = True
        if self.find_unused_parameters and not self.static_graph:
            # Outputs the loss leaves out still reach the backward (with None gradients), so the
            # parameters behind them report in as locally unused, as with torch's _DDPSink.
            out = through_sink(out, clone=self._ddp_sink_clone)
        if self._delayed is not None:
            self._delayed.after_forward()  # delayed parameters' .grad: views of their flat buffer
        return out

    def _maybe_rebuild(self) -> None:
        if (not self._has_rebuilt and self._last_order is not None
                and (self.static_graph or not self.find_unused_parameters)):
            self._rebuild(self._last_order)

    _last_order = None
    _expect_hooks = False
    _ready_clock = None
    # The collective each bucket runs and the ones after the step, for bucket_cap_mb="auto"'s
    # planner; ZeRO2 states its own.
    _auto_collectives: tuple = ("all_reduce", ())
    _comm_hook_owns_grads = False  # set by hybrid.torch.ZeRO2, whose hook keeps the gradients

    def _ensure_prior_reduction_finished(self):
        state = self._state
        if self._expect_hooks and state is not None and state.started and not state.finished:
            raise self._logged(RuntimeError(unfinished_reduction_message(
                self._ranks.rank, state.missing(), self._names, static_graph=self.static_graph,
                find_unused_parameters=self.find_unused_parameters)))

    # ---- backward ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Use ``hook(state, bucket) -> Future`` instead of the built-in all-reduce (torch's protocol)."""
        if not callable(hook):
            raise self._logged(TypeError("Communication hook must be callable."), python=True)
        self.logger.set_comm_hook(hook.__qualname__)  # torch logs it before its once-only check
        self._set_comm_hook(state, hook)

    def _set_comm_hook(self, state: object, hook: Callable, *, builtin: bool = False) -> None:
        if self._comm_hook is not None:
            # torch's reducer names the method called first.
            names = ["register_comm_hook", "register_builtin_comm_hook"][::-1 if builtin else 1]
            raise self._logged(RuntimeError(f"{names[0]} or {names[1]} can only be called once."))
        self._comm_hook = (state, hook)
        self._buckets.use_comm_hook()

    def _set_sparse_metadata(self, global_unique_ids) -> None:
        """torch's: per sparse parameter name, the sorted ids of the rows that exist globally, for
        the next synchronizing backward (hybrid/torch/ddp/reducer/_sparse.py)."""
        self._sparse.set_metadata(global_unique_ids)

    # ---- Join -------------------------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """torch's ``DistributedDataParallel.join``: a ``Join`` context over this module alone."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group
