"""The pure part of a batched copy: which casts are done, the (src, dst, numel) copy lists, and
the check that a call's tensors are the bucket's members. No torch, no JAX."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hybrid.core import BucketPlan, canonical_dtype

# dtype codes of the C ABI (kernels/batched_copy.cuh); anything else is copied as raw bytes
CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4}
_FLOATS = ("float32", "float16", "bfloat16")


def _check_cast(src: str, dst: str, scale: float | None) -> None:
    if src == dst and scale is None:
        return
    if src == dst == "float64" or (src in _FLOATS and dst in _FLOATS):
        return
    raise ValueError(f"batched copy casts and scales only float32/float16/bfloat16 (and scales "
                     f"float64 in place), got {src} -> {dst}" + ("" if scale is None else f" scale={scale}"))


def gather_copies(src_ptrs: Sequence[int], numels: Sequence[int], offsets: Sequence[int], out_ptr: int,
                  length: int, out_itemsize: int) -> tuple[list[int], list[int], list[int]]:
    """The (src, dst, numel) copy list of a gather; src 0 means "write zeros" (gaps, padding)."""
    srcs, dsts, ns, end = [], [], [], 0
    for p, n, o in zip(src_ptrs, numels, offsets):
        if o > end:
            srcs.append(0), dsts.append(out_ptr + end * out_itemsize), ns.append(o - end)
        srcs.append(p), dsts.append(out_ptr + o * out_itemsize), ns.append(n)
        end = o + n
    if length > end:
        srcs.append(0), dsts.append(out_ptr + end * out_itemsize), ns.append(length - end)
    return srcs, dsts, ns


def scatter_copies(flat_ptr: int, flat_itemsize: int, offsets: Sequence[int], dst_ptrs: Sequence[int],
                   numels: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """The (src, dst, numel) copy list of a scatter."""
    return [flat_ptr + o * flat_itemsize for o in offsets], list(dst_ptrs), list(numels)


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    return canonical_dtype(dtype)


def _members(plan: BucketPlan, bucket_index: int, tensors: Sequence, what: str) -> list:
    if not 0 <= bucket_index < len(plan.buckets):
        raise ValueError(f"bucket_index {bucket_index} out of range for {len(plan.buckets)} buckets")
    if len(tensors) != len(plan.specs):
        raise ValueError(f"{what} needs one tensor per spec ({len(plan.specs)}), got {len(tensors)}")
    bucket = plan.buckets[bucket_index]
    out = []
    for m in bucket.members:
        spec, t = plan.specs[m], tensors[m]
        if tuple(t.shape) != spec.shape or _dtype_name(t.dtype) != spec.dtype:
            raise ValueError(f"tensor {spec.name!r}: expected {spec.dtype}{list(spec.shape)}, "
                             f"got {_dtype_name(t.dtype)}{list(t.shape)}")
        out.append(t)
    return out
