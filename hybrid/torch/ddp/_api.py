"""torch's smaller ``DistributedDataParallel`` methods that trainers call after construction:
``_set_static_graph``, ``_register_builtin_comm_hook``, ``_register_fused_optim``,
``will_sync_module_buffers``, ``_get_ddp_logging_data`` (with what feeds its logger); and the
process group a ``device_mesh`` stands for."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from hybrid.torch.ddp._logging import DDPLogger, nbytes

# torch's C++ built-in hooks and the Python hooks that compute the same thing: divide by the
# world size, then all-reduce (FP16_COMPRESS: in float16, decompressed into the bucket).
_BUILTIN_HOOKS = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                  dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}


class TorchMethods:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`."""

    # torch's own static helpers, unchanged: they mark and read ``_ddp_ignored`` on the module's
    # tensors and ``_ddp_params_and_buffers_to_ignore`` on the module, which ours honours too.
    _set_params_and_buffers_to_ignore_for_model = staticmethod(
        _TorchDDP._set_params_and_buffers_to_ignore_for_model)
    _get_data_parallel_params = staticmethod(_TorchDDP._get_data_parallel_params)

    _ddp_sink_clone = True

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the find_unused_parameters sink clones the outputs (torch's default: True,
        so a loss modified in place does not trip autograd's view check)."""
        self._ddp_sink_clone = val

    # torch keeps these DataParallel-era helpers "for BC"; same bodies.
    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs, kwargs, device_id):
        return _to_kwargs(inputs, kwargs, torch.device(self.device.type, device_id),
                          os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1")

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's rules)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._iteration > 0:
            # torch also raises here (from its C++ reducer), though it has flipped its Python flag.
            raise self._logged(RuntimeError("set_static_graph() should be called before training loop starts "
                                            "and after DistributedDataParallel is constructed."))
        self.static_graph = True
        self._layout_settings["static_graph"] = True
        self.logger.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
                "will detect unused parameters automatically, so you do not need to set "
                "find_unused_parameters=true, just be sure these unused parameters will not change during "
                "training loop while calling `_set_static_graph`.", stacklevel=2)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``, ``FP16_COMPRESS``), run
        as the Python hooks of ``default_hooks`` that compute the same result."""
        if comm_hook_type not in _BUILTIN_HOOKS:
            raise ValueError(f"Unknown built-in DDP comm hook type {comm_hook_type!r}; expected one of "
                             f"{sorted(map(str, _BUILTIN_HOOKS))}")
        self.logger.set_comm_hook(str(comm_hook_type))  # torch logs the type, before its once-only check
        self._set_comm_hook(self.process_group, _BUILTIN_HOOKS[comm_hook_type], builtin=True)

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs) -> None:
        """Step ``optim`` (a ``torch.optim`` class; ``args`` / ``kwargs`` its settings) on each
        bucket's parameters as soon as that bucket is all-reduced, inside the backward (torch's
        optimizer overlap). ``optim_params``: only these parameters (default: all of them).

        torch's own pieces do it: the functional optimizer of ``optim`` wrapped around
        ``allreduce_hook`` by ``_hook_then_optimizer``, registered as this DDP's comm hook, so it
        counts as the one comm hook a DDP may have (before or after another hook: RuntimeError).
        ``.grad`` still holds the averaged gradient after the backward, as in torch.
        """
        # Imported here as torch does: the module imports FSDP and torch's DDP class.
        from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

        overlapped = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
        try:
            overlapped.register_ddp(self)
        except NotImplementedError as e:
            raise RuntimeError(f"{optim} does not support overlapped DDP. Please file an issue to PyTorch "
                               f"or the respective owner of {optim}.") from e

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the module's buffers (torch's rule)."""
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._buffer_sync.buffers)

    # ---- logging data (hybrid/torch/ddp/_logging.py keeps it as torch's C++ Logger) ------------

    logger: DDPLogger | None = None  # torch's: None where no reducer is built (every parameter delayed)

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
        """``error``, first recorded as torch records the errors its DDP raises after construction:
        ``has_error``, the text (prefixed with the type for those torch raises from Python) and the
        current iteration count."""
        if self.logger is not None:
            self.logger.set_error_and_log(f"{type(error)}: {error}" if python else str(error),
                                          iteration=self._iteration)
        return error

    def _buckets_in_bytes(self) -> tuple[list[int], list[list[int]]]:
        """The buckets in use: each one's parameter bytes and its members (torch's logger's view)."""
        members = self.bucket_plan.bucket_indices()
        return [sum(nbytes(self._params[m]) for m in ms) for ms in members], members

    def _log_construction(self) -> None:
        """A fresh logger, filled as torch's ``_ddp_init_helper`` fills it."""
        # torch's bucket_bytes_cap: the largest cap of a list, and a negative cap as it is.
        caps_mb = self._layout_settings["bucket_cap_mb_list"] or [self._layout_settings["bucket_cap_mb"]]
        cap_mb = 25 if caps_mb in ([None], ["auto"]) else max(caps_mb)  # auto starts from torch's caps
        self.logger = DDPLogger()
        self.logger.set_construction_data(
            module_name=type(self.module).__name__, device_ids=self.device_ids, output_device=self.output_device,
            broadcast_buffers=self.forward_sync_buffers,
            has_sync_bn=any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules()),
            static_graph=self.static_graph, process_group=self.process_group, params=self._params,
            bucket_sizes=self._buckets_in_bytes()[0], bucket_cap_bytes=int(cap_mb * 1024 * 1024),
            find_unused_parameters=self.find_unused_parameters, gradient_as_bucket_view=self.gradient_as_bucket_view)

    def _log_runtime_stats(self) -> None:
        """At a synchronizing forward, before it counts: the last synchronizing iteration's facts
        (torch's ``set_runtime_stats_and_log``; only sampled iterations are logged)."""
        if not self.logger.should_collect(self._iteration):
            return
        state = self._state
        # torch logs the order its gradient hooks fired in: not the unused parameters it marks
        # ready itself, and nothing for static_graph's first (delayed) iteration.
        order = () if state is None or self._delaying else [i for i in state.ready_order if i not in state.unused]
        self.logger.set_runtime_stats_and_log(
            iteration=self._iteration, num_buckets_reduced=self._num_buckets_reduced,
            unused_parameter_size=sum(nbytes(self._params[i]) for i in self._pending_unused),
            has_rebuilt_buckets=self._has_rebuilt, buckets=self._buckets_in_bytes, grad_ready_order=order)

    def _note_unused(self, unused: tuple[int, ...]) -> None:
        """find_unused_parameters without static_graph: the unused parameters this iteration found.
        torch logs ``can_set_static_graph`` = 0 (once per process) when they first change."""
        if self._graph_static:
            if self._iteration > 1 and unused != self._prev_unused:
                self._graph_static = False
                self.logger.log_if_graph_static(False, iteration=self._iteration)
            self._prev_unused = unused


def process_group_for(process_group, device_mesh, module):
    """The process group DDP reduces over: ``process_group``, the default group, or dimension 0
    of a one-dimensional ``device_mesh`` (torch's rules and messages)."""
    if process_group and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is None:
        return process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        # Sliced from a larger mesh (DDP over tensor parallelism): torch turns the module's
        # DTensor parameters into local tensors for DDP, with the same function.
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        _pre_dp_module_transform(module)
    return device_mesh.get_group(mesh_dim=0)
