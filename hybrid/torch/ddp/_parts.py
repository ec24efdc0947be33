"""What hybrid's DDP reduces: its parameters (torch's order), their specs, and the bucket a comm hook gets."""

from __future__ import annotations

import torch
from torch import nn

from hybrid.core import TensorSpec, canonical_dtype


def expects_sparse_gradient(owner: nn.Module) -> bool:
    """Whether DDP expects a sparse gradient for a parameter first owned by ``owner`` (torch's
    ``_build_params_for_reducer`` rule: an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True``).

    >>> expects_sparse_gradient(torch.nn.Embedding(4, 2, sparse=True)), expects_sparse_gradient(torch.nn.Linear(2, 1))
    (True, False)
    """
    return isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and bool(owner.sparse)


def _reduced_with_owners(module: nn.Module, ignore=frozenset()) -> list[tuple[str, nn.Parameter, nn.Module]]:
    """(name, parameter, owning module) for each parameter DDP reduces: requires_grad, not ignored,
    shared ones once, under their first owner.

    Same order as torch's ``_build_params_for_reducer`` (named_modules, then each module's own
    parameters), which fixes the registration order the bucket plan is built on.
    """
    out, memo = [], set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.requires_grad and name not in ignore and p not in memo:
                memo.add(p)
                out.append((name, p, m))
    return out


def _reduced_parameters(module: nn.Module, ignore=frozenset()) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs DDP reduces, in registration order (:func:`_reduced_with_owners`)."""
    return [(name, p) for name, p, _ in _reduced_with_owners(module, ignore)]


def specs(module: nn.Module, ignore=None) -> list[TensorSpec]:
    """TensorSpecs of the parameters DDP reduces, in registration order; ``sparse`` marks the
    weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` (a bucket of their own).

    Args:
      module: the wrapped module.
      ignore: names DDP leaves out (a DDP's ``parameters_to_ignore``); default: the module's
        ``_ddp_params_and_buffers_to_ignore``.

    >>> model = torch.nn.Sequential(torch.nn.Embedding(4, 2, sparse=True), torch.nn.Linear(2, 1))
    >>> [(s.name, s.sparse) for s in specs(model)]
    [('0.weight', True), ('1.weight', False), ('1.bias', False)]
    >>> [s.name for s in specs(torch.nn.Linear(2, 3), ignore={"bias"})]
    ['weight']
    """
    if ignore is None:
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return [TensorSpec(n, tuple(p.shape), canonical_dtype(p.dtype), str(p.device), expects_sparse_gradient(m))
            for n, p, m in _reduced_with_owners(module, ignore)]


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
