"""ZeRO-2's gradients after backward: clipping over the slices, and what ``param.grad`` holds.

Once a bucket is reduce-scattered each rank keeps only its slice of the averaged gradient, so
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` has no full gradient to read. Instead
of ``None`` (which torch's clip functions skip, returning ``tensor(0.)`` and clipping nothing),
every ``param.grad`` holds a :class:`GradientInShards`: it has the parameter's shape, dtype and
device, takes one element of memory, and any operation on it raises a ``TypeError`` that names
the parameter and the ZeRO2 method to use. The clipping itself is in ``_clip``.
"""

from __future__ import annotations

import torch

_ADVICE = ("Its gradient was reduce-scattered by hybrid.torch.ZeRO2 or ZeRO3: each rank holds only its slice, "
           "inside the optimizer (for ZeRO3: hybrid.torch.ZeRO3Optimizer, not a torch.optim optimizer over "
           "model.parameters()). Clip with opt.clip_grad_norm_(max_norm, norm_type) or opt.clip_grad_value_(value) "
           "instead of torch.nn.utils' clip functions; opt.clip_grad_norm_(float('inf')) returns the total "
           "norm without clipping, for logging.")


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def shared_zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero scalar per dtype and device, that every stand-in expands (nothing writes it: the
    stand-ins refuse every read and write of their values), so a stand-in costs no memory.

    >>> shared_zero(torch.float32, torch.device("cpu")) is shared_zero(torch.float32, torch.device("cpu"))
    True
    """
    key = (dtype, torch.device(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), dtype=dtype, device=device)
    return _ZEROS[key]


class GradientInShards(torch.Tensor):
    """What ``param.grad`` holds between a ZeRO2 backward and the next forward (or ``zero_grad``).

    Its shape, dtype and device are the parameter's; everything else raises a ``TypeError``.

    >>> g = GradientInShards.of(torch.nn.Parameter(torch.ones(2, 3)), "fc.weight")
    >>> g.shape, g.dtype
    (torch.Size([2, 3]), torch.float32)
    >>> g.norm()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: parameter 'fc.weight': norm is not available. Its gradient was reduce-scattered ...
    """

    param_name: str

    @staticmethod
    def of(param: torch.Tensor, name: str) -> "GradientInShards":
        """A stand-in shaped like ``param`` (a zero scalar expanded: no memory of its own)."""
        out = torch.Tensor._make_subclass(GradientInShards, shared_zero(param.dtype, param.device).expand(param.shape))
        out.param_name = name
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "__get__":  # shape, dtype, device, is_sparse ...
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        stand_in = next(a for a in (*args, *(kwargs or {}).values(), *_flat(args)) if isinstance(a, cls))
        raise TypeError(f"parameter {stand_in.param_name!r}: {getattr(func, '__name__', func)} is not "
                        f"available. {_ADVICE}")

    def __repr__(self) -> str:  # a debugger or print() must not raise
        return f"GradientInShards({self.param_name!r}, shape={tuple(self.shape)})"


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
