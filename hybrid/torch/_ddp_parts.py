"""The small pieces of hybrid's DDP: the parameters it reduces, their specs, the comm hook's bucket."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybrid import kernels
from hybrid.core import TensorSpec, canonical_dtype


def _reduced_parameters(module: nn.Module, ignore=frozenset()) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs DDP reduces: requires_grad, not ignored, shared ones once.

    Same order as torch's ``_build_params_for_reducer`` (named_modules, then each module's own
    parameters), which fixes the registration order the bucket plan is built on.
    """
    out, memo = [], set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.requires_grad and name not in ignore and p not in memo:
                memo.add(p)
                out.append((name, p))
    return out


def specs(module: nn.Module, ignore=None) -> list[TensorSpec]:
    """TensorSpecs of the parameters DDP reduces, in registration order.

    Args:
      module: the wrapped module.
      ignore: names DDP leaves out (a DDP's ``parameters_to_ignore``); default: the module's
        ``_ddp_params_and_buffers_to_ignore``.

    >>> [s.name for s in specs(torch.nn.Linear(2, 3))]
    ['weight', 'bias']
    >>> [s.name for s in specs(torch.nn.Linear(2, 3), ignore={"bias"})]
    ['weight']
    """
    if ignore is None:
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return [TensorSpec(n, tuple(p.shape), canonical_dtype(p.dtype), str(p.device))
            for n, p in _reduced_parameters(module, ignore)]


class GradBucket:
    """The bucket a comm hook receives; the methods of ``torch.distributed.GradBucket``."""

    def __init__(self, index, buffer, gradients, parameters, is_last):
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


def _find_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # torch's _find_tensors too
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


def _reachable_params(outputs) -> set[int]:
    """ids of leaf tensors whose AccumulateGrad node is reachable from ``outputs``' graph."""
    seen, found = set(), set()
    stack = [t.grad_fn for t in _find_tensors(outputs) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def _bucket_copy_backend(device: torch.device) -> str:
    """``"cuda"`` when copies between gradients and buckets on ``device`` go through
    :mod:`hybrid.kernels` (CUDA tensors, library built, unless ``HYBRID_KERNELS=reference``),
    else ``"reference"``: torch's own (foreach) copies, as on CPU.

    >>> _bucket_copy_backend(torch.device("cpu"))
    'reference'
    """
    if device.type != "cuda":
        return "reference"
    return kernels.resolve_backend(None, on_cuda=True)


def _unsupported(name, value, default):
    if value is not default and value != default:
        raise NotImplementedError(f"hybrid.torch.DistributedDataParallel does not support {name}={value!r}")
