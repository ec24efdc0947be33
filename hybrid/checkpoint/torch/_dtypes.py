"""torch tensors as the numpy arrays a checkpoint stores, and back, bit for bit, for every dtype
(``hybrid.checkpoint._dtypes``): numpy's own dtypes as themselves (complex included), bfloat16,
the float8 types and complex32 as the unsigned integers of their size, viewed, never converted.
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid.core import canonical_dtype
from hybrid.checkpoint._dtypes import check_storable, is_stored_as_bits, storage_dtype

_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` on the host as its stored dtype: a view of its memory where it is contiguous on the CPU.

    >>> to_numpy(torch.tensor([1.0], dtype=torch.bfloat16)), to_numpy(torch.tensor([1j])).dtype
    (array([16256], dtype=uint16), dtype('complex64'))
    """
    t = t.detach().cpu().contiguous()
    if is_stored_as_bits(canonical_dtype(t.dtype)):
        t = t.view(_BITS[t.element_size()])
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype, saved: str | None = None) -> torch.Tensor:
    """The stored array ``a``, of logical dtype ``saved`` (default: ``dtype`` where ``a`` holds
    its stored bits, else ``a``'s own), as a tensor of ``dtype``: the bits viewed (a view of ``a``'s
    memory), then converted where ``saved`` is not ``dtype`` (a copy).

    >>> from_numpy(np.array([16256], np.uint16), torch.bfloat16)
    tensor([1.], dtype=torch.bfloat16)
    >>> from_numpy(np.array([16256], np.uint16), torch.float32, "bfloat16")
    tensor([1.])
    """
    t = torch.from_numpy(np.ascontiguousarray(a))
    if saved is None:
        saved = canonical_dtype(dtype) if a.dtype == storage_dtype(canonical_dtype(dtype)) else canonical_dtype(a.dtype)
    if is_stored_as_bits(saved):
        t = t.view(getattr(torch, saved))
    return t.to(dtype)


def check_tensors(named, *, where: str) -> None:
    """Raise CheckpointError naming the first of ``named`` (``(name, tensor)`` pairs) whose dtype
    no checkpoint holds (a quantized or bit-packed tensor), before anything is written."""
    check_storable({name: t.dtype for name, t in named}, where=where)


def logical_dtypes(named) -> dict[str, str]:
    """``{name: dtype name}`` of ``(name, tensor)`` pairs: what a manifest records of each."""
    return {name: canonical_dtype(t.dtype) for name, t in named}
