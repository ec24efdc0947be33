"""Parameters moved into one flat tensor per bucket, each parameter a view of it.

ZeroRedundancyOptimizer's ``parameters_as_bucket_view``, ZeRO2 and the overlap hooks all keep
parameters this way, so that one collective reads or writes many of them in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.core import Bucket


@torch.no_grad()
def params_into_flat(params: Sequence[torch.Tensor], bucket: Bucket, length: int | None = None) -> torch.Tensor:
    """Copy ``bucket``'s members of ``params`` into a new flat tensor laid out as the bucket says,
    and make each member's ``.data`` a view of it. Gaps and padding (up to ``length``, default
    the bucket's own) are zeros. Values are unchanged, so this is safe even during backward.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> ps = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.full((1, 2), 3.0))]
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> flat = params_into_flat(ps, plan.buckets[0], length=5)
    >>> flat.tolist(), ps[1].data_ptr() == flat[2:].data_ptr()
    ([1.0, 1.0, 3.0, 3.0, 0.0], True)
    """
    first = params[bucket.members[0]]
    flat = torch.zeros(bucket.length if length is None else length, dtype=first.dtype, device=first.device)
    for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
        p = params[m]
        flat[o:o + n].copy_(p.detach().reshape(-1))
        p.data = flat[o:o + n].view_as(p)
    return flat
