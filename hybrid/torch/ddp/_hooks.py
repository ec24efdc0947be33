"""The comm hooks torch's DDP registers for its users besides ``register_comm_hook``: its C++
built-in hooks, run as the Python hooks that compute the same, and ``_register_fused_optim``'s
optimizer overlap, built from torch's own pieces."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# torch's C++ built-in hooks and the Python hooks that compute the same thing: divide by the
# world size, then all-reduce (FP16_COMPRESS: in float16, decompressed into the bucket).
_BUILTIN_HOOKS = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                  dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}


def builtin_hook(comm_hook_type) -> Callable:
    """The Python hook computing what torch's built-in ``comm_hook_type`` computes (its state:
    the process group).

    >>> builtin_hook(dist.BuiltinCommHookType.ALLREDUCE).__name__
    'allreduce_hook'
    """
    if comm_hook_type not in _BUILTIN_HOOKS:
        raise ValueError(f"Unknown built-in DDP comm hook type {comm_hook_type!r}; expected one of "
                         f"{sorted(map(str, _BUILTIN_HOOKS))}")
    return _BUILTIN_HOOKS[comm_hook_type]


def register_fused_optim(ddp, optim, *args, optim_params=None, **kwargs) -> None:
    """torch's ``_register_fused_optim``: the functional optimizer of ``optim`` wrapped around
    ``allreduce_hook`` by ``_hook_then_optimizer``, registered as ``ddp``'s comm hook (so it
    counts as the one comm hook a DDP may have)."""
    # Imported here as torch does: the module imports FSDP and torch's DDP class.
    from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

    overlapped = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
    try:
        overlapped.register_ddp(ddp)
    except NotImplementedError as e:
        raise RuntimeError(f"{optim} does not support overlapped DDP. Please file an issue to PyTorch "
                           f"or the respective owner of {optim}.") from e
