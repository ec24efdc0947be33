"""Clipping over gradient slices: the norm of the whole gradient, as exact as torch's or better.

ZeRO2 and ZeRO3 hold each rank's gradient as a few long flat slices (a bucket's share), where
torch's ``clip_grad_norm_`` sees one tensor per parameter. On the CPU, ``torch.linalg.vector_norm``
of a float32 tensor accumulates its terms in float32 one after another, so its rounding grows with
the tensor's length: ~1e-6 relative at 250k elements and ~1e-4 at 4M, where the same terms cut in
per-parameter tensors (torch's) stay within ~4e-7. So the norm here never reduces a long run of
terms in float32: each slice is cut in blocks of ``_BLOCK`` elements whose norms are computed in
float64 (``vector_norm(..., dtype=float64)``; the float64 copy of one block is the only temporary),
the ranks' partial sums are all-reduced in float64, and the total is rounded once to the
gradients' dtype, as torch returns it. Measured on a 6M-element float32 slice: 4e-14 relative to
the float64 norm, in the time of one float32 ``vector_norm``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

_BLOCK = 1 << 18  # elements per float64 partial norm: a 2 MiB temporary, and few launches per bucket


def _powers(s: torch.Tensor, p: float) -> torch.Tensor:
    """``sum(|s| ** p)`` (or ``max(|s|)`` for ``inf``) in float64, a block at a time."""
    blocks = s.reshape(-1).split(_BLOCK)
    norms = torch.stack(torch._foreach_norm(blocks, p, dtype=torch.float64))
    return norms.max() if p == math.inf else norms.pow(p).sum()


def total_norm(slices: list[torch.Tensor], norm_type: float, *, group, device: torch.device) -> torch.Tensor:
    """The ``norm_type`` norm of every rank's ``slices`` together (a collective), accumulated in
    float64 and returned in the slices' dtype (float32 where there are none), as torch's
    ``clip_grad_norm_`` returns the norm of the gradients. Zero padding adds nothing to it.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> x = torch.full((1 << 20,), 0.1)
    >>> got = total_norm([x, torch.zeros(3)], 1.0, group=None, device=x.device)
    >>> got.dtype, float(got) == float(torch.linalg.vector_norm(x.double(), 1.0).float())
    (torch.float32, True)
    >>> dist.destroy_process_group()
    """
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}")
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in slices), slices[0].dtype) if slices \
        else torch.float32
    parts = [_powers(s, p).to(device) for s in slices if s.numel()]
    if p == math.inf:
        partial = torch.stack(parts).max() if parts else torch.zeros((), dtype=torch.float64, device=device)
        dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
        return partial.to(dtype)
    partial = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(partial, group=group)
    return partial.pow(1.0 / p).to(dtype)


def clip_grad_norm_(slices: list[torch.Tensor], max_norm: float, norm_type: float, *, group,
                    device: torch.device, error_if_nonfinite: bool) -> torch.Tensor:
    """Clip every rank's gradient slices by the norm of the whole gradient; return that norm.

    The norm is :func:`total_norm`'s; each slice is then scaled by torch's
    ``clamp(max_norm / (total + 1e-6), max=1)``, computed in the norm's dtype as torch does.
    """
    total = total_norm(slices, norm_type, group=group, device=device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                           "the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if slices:
        torch._foreach_mul_(slices, coef)
    return total
