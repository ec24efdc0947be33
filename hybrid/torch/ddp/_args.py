"""The DDP constructor's arguments, checked and resolved as torch's are: the process group, the
device, how buffers are synced, and what decides the bucket layout (caps, ``"auto"``), each into
plain values before any part is built."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from hybrid.core import ddp_size_limits
from hybrid.torch.ddp._auto import AUTO

_MB = 1024 * 1024


def check_torch_args(delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction) -> None:
    """torch's checks of the arguments it takes as they are: the delayed all-reduce's pair, and
    the deprecated ``check_reduction`` (a warning pointing at the caller of the constructor)."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                         "need to be set at the same time.")
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)


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


def module_device(module_params: list[torch.Tensor], device_ids, output_device) -> torch.device:
    """The device of the module's parameters (every one not ignored, frozen ones too, as torch),
    after torch's checks of ``device_ids`` and ``output_device`` against it."""
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
    return module_params[0].device


def buffer_sync_flags(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
    """(sync the buffers at every forward, sync them at construction), from torch 2.13's two
    spellings, with its deprecation warnings (pointing at the caller of the constructor)."""
    if broadcast_buffers is not None and forward_sync_buffers is not None:
        warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                      "`broadcast_buffers` is deprecated and its value is ignored when "
                      "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
    elif broadcast_buffers is not None:
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                      "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` "
                      "still syncs buffers at init.", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    every_forward = broadcast_buffers is None or bool(broadcast_buffers)
    return every_forward, every_forward


def check_auto(bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters, static_graph) -> bool:
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


def bucket_layout(bucket_cap_mb, bucket_cap_mb_list, *, find_unused_parameters: bool,
                  static_graph: bool) -> tuple[bool, dict, tuple, tuple]:
    """(whether the caps are ``"auto"``, the layout settings ranks must agree on, the initial
    plan's and the rebuilt plan's size limits), from torch's cap arguments."""
    # bucket_cap_mb="auto": hybrid's own, opt-in; torch's numbers keep torch's meaning.
    auto = check_auto(bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters, static_graph)
    # What decides the bucket layout, as the user spelled it (DDP adds its mixed precision).
    settings = {"bucket_cap_mb": bucket_cap_mb, "bucket_cap_mb_list": bucket_cap_mb_list,
                "find_unused_parameters": bool(find_unused_parameters), "static_graph": bool(static_graph)}
    # The initial plan, and anything that asks for caps, gets torch's defaults under "auto".
    initial, rebuilt = size_limits(None if auto else bucket_cap_mb, bucket_cap_mb_list, static_graph=static_graph,
                                   find_unused_parameters=find_unused_parameters)
    return auto, settings, initial, rebuilt


def size_limits(bucket_cap_mb, bucket_cap_mb_list, *, static_graph: bool, find_unused_parameters: bool):
    """(the initial plan's, the rebuilt plan's) :func:`hybrid.core.ddp_size_limits` for torch's
    ``bucket_cap_mb`` (None: torch's defaults) or ``bucket_cap_mb_list``.

    >>> size_limits(None, None, static_graph=False, find_unused_parameters=False)  # one bucket, then 1 and 25 MiB
    ((9223372036854775807,), (1048576, 26214400))
    >>> size_limits(None, [1, 4], static_graph=False, find_unused_parameters=False)[1]
    (1048576, 4194304)
    """
    if bucket_cap_mb_list:
        caps = tuple(_cap_bytes(mb) for mb in bucket_cap_mb_list)
        return ddp_size_limits(bucket_caps_bytes=caps, static_graph=static_graph,
                               find_unused_parameters=find_unused_parameters)
    return ddp_size_limits(bucket_cap_bytes=None if bucket_cap_mb is None else _cap_bytes(bucket_cap_mb),
                           static_graph=static_graph, find_unused_parameters=find_unused_parameters)
