"""torch's smaller ``DistributedDataParallel`` methods that trainers call after construction:
``_set_static_graph``, ``_register_builtin_comm_hook``, ``_register_fused_optim``,
``will_sync_module_buffers``, ``_get_ddp_logging_data``; and the process group a ``device_mesh``
stands for."""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from hybrid.core import plan_buckets
from hybrid.torch._ddp_parts import specs

# torch's C++ built-in hooks and the Python hooks that compute the same thing: divide by the
# world size, then all-reduce (FP16_COMPRESS: in float16, decompressed into the bucket).
_BUILTIN_HOOKS = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                  dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}

# c10's dtype names, as torch's logger spells them in "dtypes".
_C10_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}


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
            raise RuntimeError("set_static_graph() should be called before training loop starts and "
                               "after DistributedDataParallel is constructed.")
        self.static_graph = True
        self._layout_settings["static_graph"] = True
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
        self.register_comm_hook(self.process_group, _BUILTIN_HOOKS[comm_hook_type])

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
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._buffers_to_sync)

    def _get_ddp_logging_data(self) -> dict:
        """The construction-time part of torch's logging data, with torch's keys and formats
        (runtime timings and sampled per-iteration stats are not collected)."""
        cap_mb = self._layout_settings["bucket_cap_mb"]
        return {
            "backend_name": dist.get_backend(self.process_group),
            # The buckets built at construction, as torch logs them (ddp.bucket_plan: those in use).
            "bucket_sizes": ", ".join(str(b.nbytes) for b in plan_buckets(
                specs(self.module, self.parameters_to_ignore), size_limits=self._initial_limits).buckets),
            "device_ids": ", ".join(map(str, self.device_ids or [])),
            "dtypes": ", ".join(sorted({_C10_NAMES.get(p.dtype, str(p.dtype)) for p in self._params})),
            "module_name": type(self.module).__name__,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": 25 * 1024 * 1024 if cap_mb is None else
            (sys.maxsize if cap_mb < 0 else int(cap_mb * 1024 * 1024)),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": 0,
            "num_parameter_tensors": len(self._params),
            "output_device": -1 if self.output_device is None else int(self.output_device),
            "rank": self._rank,
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in self._params),
            "world_size": self._world,
        }


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
