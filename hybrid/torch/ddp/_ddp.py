"""A drop-in ``torch.nn.parallel.DistributedDataParallel`` whose buckets come from hybrid.core.

The class is a shell: torch's constructor, methods, attributes and hook protocol, over parts it
holds as objects (hybrid/torch/ddp/__init__.py lists them and what each owns). The layout (bucket
membership, offsets, rebuild) is decided by ``hybrid.core``; the per-iteration bookkeeping is
``hybrid.core._reducer_state``; the parts move tensors and issue ``torch.distributed`` collectives.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.nn.parallel.distributed import _BufferCommHookLocation

from hybrid.core import BucketPlan
from hybrid.torch._collectives import naming
from hybrid.torch.ddp import _forward  # torch.compile(ddp) splits graphs there (hybrid.torch.dynamo)
from hybrid.torch.ddp._args import bucket_layout, buffer_sync_flags, check_torch_args, module_device, process_group_for
from hybrid.torch.ddp._buffers import BufferSync
from hybrid.torch.ddp._delay import DelayedAllReduce
from hybrid.torch.ddp._hooks import builtin_hook, register_fused_optim
from hybrid.torch.ddp._join import _JoinHook
from hybrid.torch.ddp._logging import DDPLogger, record_construction
from hybrid.torch.ddp._mixed import MixedPrecision, _allreduce_and_upcast_hook
from hybrid.torch.ddp._parts import GradBucket, specs  # noqa: F401 - re-exported by hybrid.torch
from hybrid.torch.ddp._parts import _reduced_parameters
from hybrid.torch.ddp._pickle import pickled_state, restore_pickled
from hybrid.torch.ddp._sink import through_sink
from hybrid.torch.ddp._sync import BROADCAST_BUCKET_BYTES, RankAgreement
from hybrid.torch.ddp.reducer import Reducer

class DistributedDataParallel(nn.Module, Joinable):
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

    # torch's own static helpers, unchanged: they mark and read ``_ddp_ignored`` on the module's
    # tensors and ``_ddp_params_and_buffers_to_ignore`` on the module, which ours honours too.
    _set_params_and_buffers_to_ignore_for_model = staticmethod(
        _TorchDDP._set_params_and_buffers_to_ignore_for_model)
    _get_data_parallel_params = staticmethod(_TorchDDP._get_data_parallel_params)

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        Joinable.__init__(self)
        check_torch_args(delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction)
        self.process_group = process_group_for(process_group, device_mesh, module)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # The delayed parameters, chosen before the reduced ones: they join parameters_to_ignore.
        delayed = list(delay_all_reduce_named_params or ())
        self._delayed = DelayedAllReduce(delayed, param_to_hook_all_reduce) if delayed else None
        self.parameters_to_ignore.update(name for name, _ in delayed)
        named = _reduced_parameters(module, self.parameters_to_ignore)
        if not named and not delayed:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        self.device = module_device([p for n, p in module.named_parameters() if n not in self.parameters_to_ignore],
                                    device_ids, output_device)
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device if output_device is not None else (device_ids[0] if device_ids else None)
        self.module = module
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self.broadcast_buffers = self.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.batched_grad_copy = batched_grad_copy
        self._ddp_sink_clone = True
        # What this DDP reduces, in torch's registration order: read by ZeRO2, ZeRO3Optimizer's
        # checkpoints and hybrid.torch.dynamo.
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._buffer_sync = BufferSync(module, self.parameters_to_ignore)
        self._ranks = RankAgreement(self.process_group, self.device)
        self._divide_by_initial_world_size = True  # Join's; its hook sets it
        self._init_sync_buffers = init_sync_buffers

        # What decides the bucket layout, as the user spelled it: ranks must agree on it.
        self._auto_caps, self._layout_settings, self._initial_limits, self._rebuild_limits = bucket_layout(
            bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters=find_unused_parameters, static_graph=static_graph)
        # Before planning: the buckets are laid out in the reduce dtype.
        self.mixed_precision = mixed_precision
        self._mixed = None if mixed_precision is None else MixedPrecision(
            mixed_precision, find_unused_parameters=find_unused_parameters)
        self._layout_settings["mixed_precision"] = None if self._mixed is None else self._mixed.layout_setting

        self._reducer: Reducer | None = None
        self.logger: DDPLogger | None = None  # torch's: None where no reducer is built
        # Every parameter delayed: torch's builds no reducer, and its forward only runs the module.
        self._delay_all_reduce_all_params = not named
        if self._delayed is not None:
            self._delayed.start(self.process_group, device_ids)
            if self._delay_all_reduce_all_params:
                return
        if init_sync:
            self._ranks.verify_same_model(self._names, self._params, self._layout_settings)
            self._sync_module_states(0)
        self._init_reducer()
        if self._mixed is not None:  # after the reducer, as torch: casts, copies, its comm hook
            self._mixed.setup(module, group=self.process_group, buckets=self._reducer.buckets, names=self._names,
                              index_of=self._index_of)
            self.register_comm_hook(weakref.ref(self._mixed), _allreduce_and_upcast_hook)

    def _init_reducer(self) -> None:
        """A fresh reducer and its logger (torch's ``_ddp_init_helper``; also what unpickling runs)."""
        bucket_specs = specs(self.module, self.parameters_to_ignore)
        if self._mixed is not None:
            bucket_specs = self._mixed.bucket_specs(bucket_specs)
        self.logger = DDPLogger()
        self._reducer = Reducer(
            self._params, self._names, bucket_specs, ranks=self._ranks, logger=self.logger,
            layout_settings=self._layout_settings,
            bucket_dtype=None if self._mixed is None else self._mixed.bucket_dtype,
            # gradient_as_bucket_view's aliasing: a full-precision .grad cannot view a bucket in
            # another dtype, so under mixed precision .grad is its own tensor (in torch too, the
            # upcast gives it its own storage; only memory differs).
            grads_in_buckets=self.gradient_as_bucket_view and self._mixed is None,
            batched_grad_copy=self.batched_grad_copy, find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph, skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            auto=self._auto_caps, initial_limits=self._initial_limits, rebuild_limits=self._rebuild_limits)
        record_construction(self.logger, self)

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
            self._reducer.prepare_for_forward()
        work = Join.notify_join_context(self)
        if work is not None:
            with naming("DistributedDataParallel forward (Join): the all-reduce that counts the ranks still training"):
                work.wait()
            self._reducer.set_divisor(self._ranks.world if self._divide_by_initial_world_size
                                      else int(work.result()[0].item()))
        if torch.is_grad_enabled():
            self._reducer.maybe_rebuild()
        if self.will_sync_module_buffers() and self._buffer_sync.syncs_before_forward():
            self._sync_buffers()
        if self._join_config.enable:
            self._ranks.backward_sync_flag(self.require_backward_grad_sync, joined=False)
        return grad_sync

    @torch.compiler.disable
    def _post_forward(self, out, grad_sync: bool):
        """The output as the caller gets it; with find_unused_parameters, through torch's sink."""
        # A POST_FORWARD buffer hook; decided, as torch, by the previous forward's sync flag.
        if self.will_sync_module_buffers() and self._buffer_sync.syncs_after_forward():
            self._sync_buffers()
        # torch's: a forward without backward sync (no_sync(), no_grad) skips the next buffer sync.
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            self._reducer.prepare_for_backward(out)
        if self.find_unused_parameters and not self.static_graph:
            # Outputs the loss leaves out still reach the backward (with None gradients), so the
            # parameters behind them report in as locally unused, as with torch's _DDPSink.
            out = through_sink(out, clone=self._ddp_sink_clone)
        if self._delayed is not None:
            self._delayed.after_forward()  # delayed parameters' .grad: views of their flat buffer
        return out

    # ---- backward: torch's methods that shape it --------------------------------------------

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
        self._reducer.register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``, ``FP16_COMPRESS``), run
        as the Python hooks of ``default_hooks`` that compute the same result."""
        hook = builtin_hook(comm_hook_type)
        self.logger.set_comm_hook(str(comm_hook_type))  # torch logs the type, before its once-only check
        self._reducer.register_comm_hook(self.process_group, hook, builtin=True)

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs) -> None:
        """Step ``optim`` (a ``torch.optim`` class; ``args`` / ``kwargs`` its settings) on each
        bucket's parameters (``optim_params``: only these) as soon as that bucket is all-reduced,
        inside the backward; ``.grad`` still holds the averaged gradient after it (torch's)."""
        register_fused_optim(self, optim, *args, optim_params=optim_params, **kwargs)

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's rules)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self._reducer.set_static_graph()  # raises after the first forward (torch has flipped its flag by then)
        self.static_graph = True
        self._layout_settings["static_graph"] = True
        self.logger.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
                "will detect unused parameters automatically, so you do not need to set "
                "find_unused_parameters=true, just be sure these unused parameters will not change during "
                "training loop while calling `_set_static_graph`.", stacklevel=2)

    def _set_sparse_metadata(self, global_unique_ids) -> None:
        """torch's: per sparse parameter name, the sorted ids of the rows that exist globally, for
        the next synchronizing backward (hybrid/torch/ddp/reducer/_sparse.py)."""
        self._reducer.set_sparse_metadata(global_unique_ids)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the find_unused_parameters sink clones the outputs (torch's default: True,
        so a loss modified in place does not trip autograd's view check)."""
        self._ddp_sink_clone = val

    # ---- buffers (torch's names, over the BufferSync part) ------------------------------------

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
        """Run ``hook(state, named_buffers)`` instead of the broadcast, before or after the forward;
        futures it returns are waited for at the end of the backward (torch's)."""
        self._buffer_sync.register_hook(state, hook, comm_hook_location)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0):
        """torch's default buffer sync (for buffer hooks): ``bufs`` broadcast from ``authoritative_rank``."""
        bufs = self._buffer_sync.buffers if bufs is None else bufs
        dist._broadcast_coalesced(self.process_group, bufs, bucket_size or BROADCAST_BUCKET_BYTES, authoritative_rank)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the module's buffers (torch's rule)."""
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._buffer_sync.buffers)

    def _sync_buffers(self, rank_cond: bool = True) -> None:
        futs = self._buffer_sync.sync(self._ranks, rank_cond=rank_cond, join_enabled=self._join_config.enable)
        if futs:
            self._reducer.install_post_backward_futures(futs)

    # ---- logging data (hybrid/torch/ddp/_logging.py keeps it as torch's C++ Logger) ------------

    def _get_ddp_logging_data(self) -> dict:
        """torch's logging data, same keys, values and moments (hybrid/torch/ddp/_logging.py)."""
        if self.logger is None:
            raise AssertionError("self.logger must not be None")
        return self.logger.data()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample runtime stats every ``sample_rate`` iterations after the tenth (default 100)."""
        if sample_rate < 1:
            raise self._logged(ValueError("DDP runtime logging sample rate should be equal or greater than 1"),
                               python=True)
        self.logger.sample_rate = sample_rate

    def _logged(self, error: Exception, *, python: bool = False) -> Exception:
        """``error``, recorded in the logging data as torch records the errors its DDP raises
        (no logger, no record: every parameter delayed)."""
        return error if self._reducer is None else self._reducer.logged(error, python=python)

    # ---- what the rest of hybrid reads: the reducer's facts, under the shell's names ----------

    @property
    def bucket_plan(self) -> BucketPlan:
        """The :class:`~hybrid.core.BucketPlan` in use."""
        return self._reducer.plan

    @property
    def _has_rebuilt(self) -> bool:  # hybrid.checkpoint.torch saves the rebuilt plan
        return self._reducer.rebuild.has_rebuilt

    @property
    def _auto_report(self) -> dict | None:  # bucket_cap_mb="auto": what its plan was made from
        return self._reducer.rebuild.auto_report

    def _maybe_rebuild(self) -> None:  # the parity harness: a one-step run reports its rebuilt plan
        self._reducer.maybe_rebuild()

    def _restore_rebuilt_plan(self, plan: BucketPlan) -> None:  # hybrid.checkpoint.torch, restore_buckets
        self._reducer.restore_rebuilt_plan(plan)

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

    # ---- pickling, as torch's: the module and the settings; the rest made anew on load -------

    def __getstate__(self):
        return pickled_state(self)

    def __setstate__(self, state):
        """Against the default group: the copy starts from the initial buckets, rebuilds them after
        its first iteration and, with ``static_graph``, records its first iteration again."""
        nn.Module.__setstate__(self, state)
        restore_pickled(self)

    # ---- torch keeps these DataParallel-era helpers "for BC" (scatter, gather: its own) ------

    scatter, gather = _TorchDDP.scatter, _TorchDDP.gather  # they read self.dim only

    def to_kwargs(self, inputs, kwargs, device_id):
        return _to_kwargs(inputs, kwargs, torch.device(self.device.type, device_id),
                          os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1")
