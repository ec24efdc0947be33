"""Bucket packing inside a traced step: hybrid.kernels' CUDA kernels on GPU, core.pack otherwise.

The plan is always the core's; only the copy that fills or empties a bucket changes. On a GPU with
the kernel library built, one FFI call (one launch per launch table) replaces XLA's concatenate and
slices, and the mean's ``1 / world_size`` rides along in the unpacking kernel. Everywhere else the
reference is ``hybrid.core.pack`` / ``unpack`` (``jnp.concatenate`` and slices that XLA fuses).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from hybrid import kernels
from hybrid.core import BucketPlan, canonical_dtype, pack, unpack


def check_backend(copy_backend) -> None:
    if copy_backend is not None and copy_backend not in kernels.BACKENDS:
        raise ValueError(f"copy_backend must be one of {kernels.BACKENDS} or None, got {copy_backend!r}")


def use_kernels(copy_backend: str | None) -> bool:
    """Whether this trace copies through the CUDA kernels.

    ``copy_backend`` (else ``$HYBRID_KERNELS``, else ``"auto"``) decides as in ``hybrid.kernels``:
    ``auto`` uses them when JAX's default backend is a GPU and the library loads, ``reference``
    never, ``cuda`` always (a RuntimeError where they cannot run). Decided at trace time, once per
    compiled step.
    """
    return kernels.resolve_jax_backend(copy_backend) == "cuda"


@functools.lru_cache(maxsize=64)
def _padded(plan: BucketPlan, bucket_index: int, length: int) -> BucketPlan:
    # The same bucket with the shard padding as its tail: the kernel writes zeros up to `length`,
    # exactly what core.pack(..., length=length) returns.
    buckets = list(plan.buckets)
    buckets[bucket_index] = dataclasses.replace(buckets[bucket_index], length=length)
    return dataclasses.replace(plan, buckets=tuple(buckets))


def pack_bucket(plan: BucketPlan, bucket_index: int, arrays, *, length: int | None = None, cuda: bool,
                into=None):
    """``core.pack(plan, bucket_index, arrays, length=length)``, by the kernel when ``cuda``.

    ``into``: a buffer of the bucket's length and dtype to write the members into (the reference
    path only; the kernel writes a fresh buffer). Its padding must be zeros, as ``init`` leaves it:
    only the members' ranges are written. Where ``into`` is donated to the jitted step, XLA
    updates it in place, so the step allocates no bucket-sized buffer to fill.
    """
    if not cuda and into is not None:
        return pack_into(plan, bucket_index, arrays, into)
    if not cuda:
        return pack(plan, bucket_index, arrays, length=length)
    if length is not None and length != plan.buckets[bucket_index].length:
        plan = _padded(plan, bucket_index, length)
    return kernels.jax_gather(plan, bucket_index, arrays, backend="cuda")


def pack_into(plan: BucketPlan, bucket_index: int, arrays, buffer):
    """Write a bucket's members into ``buffer`` at the plan's offsets: ``core.pack`` without a new array.

    One ``dynamic_update_slice`` per member, at static offsets; XLA fuses them into one in-place
    update of ``buffer``. Elements outside the members (padding) keep ``buffer``'s values.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> pack_into(plan, 0, [jnp.ones(2), jnp.full((1, 2), 2.0)], jnp.zeros(4)).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    bucket = plan.buckets[bucket_index]
    if buffer.shape != (bucket.length,) or canonical_dtype(np.dtype(buffer.dtype)) != bucket.dtype:
        raise ValueError(f"bucket {bucket_index} needs a {bucket.dtype}[{bucket.length}] buffer, "
                         f"got {canonical_dtype(np.dtype(buffer.dtype))}{list(buffer.shape)}")
    for member, offset in zip(bucket.members, bucket.offsets):
        spec, a = plan.specs[member], arrays[member]
        if tuple(a.shape) != spec.shape or canonical_dtype(np.dtype(a.dtype)) != spec.dtype:
            raise ValueError(f"tensor {spec.name!r}: expected {spec.dtype}{list(spec.shape)}, "
                             f"got {canonical_dtype(np.dtype(a.dtype))}{list(a.shape)}")
        buffer = jax.lax.dynamic_update_slice(buffer, a.reshape(-1), (offset,))
    return buffer


def unpack_bucket(plan: BucketPlan, bucket_index: int, flat, *, divisor: int | None = None, cuda: bool) -> dict:
    """``core.unpack(plan, bucket_index, flat / divisor)``, by the kernel when ``cuda``.

    The reference divides the flat bucket (XLA fuses the divide into the slices' consumers); the
    kernel multiplies by ``1 / divisor`` in float32 on the way out, which is the same result for a
    power-of-two divisor and within 1 ulp otherwise.
    """
    if not cuda:
        return unpack(plan, bucket_index, flat if divisor is None else flat / divisor)
    return kernels.jax_scatter(plan, bucket_index, flat, backend="cuda",
                               scale=None if divisor is None else 1.0 / divisor)
