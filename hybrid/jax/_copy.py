"""Bucket packing inside a traced step: hybrid.kernels' CUDA kernels on GPU, core.pack otherwise.

The plan is always the core's; only the copy that fills or empties a bucket changes. On a GPU with
the kernel library built, one FFI call (one launch per launch table) replaces XLA's concatenate and
slices, and the mean's ``1 / world_size`` rides along in the unpacking kernel. Everywhere else the
reference is ``hybrid.core.pack`` / ``unpack`` (``jnp.concatenate`` and slices that XLA fuses).
"""

from __future__ import annotations

import dataclasses
import functools

from hybrid import kernels
from hybrid.core import BucketPlan, pack, unpack


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
                out=None):
    """``core.pack(plan, bucket_index, arrays, length=length, out=out)``, by the kernel when ``cuda``.

    ``out`` (the reference path only; the kernel writes a fresh buffer) is a buffer to write the
    members into, padding left as it is; where it is donated to the jitted step, XLA updates it
    in place, so the step allocates no bucket-sized buffer to fill.
    """
    if not cuda:
        return pack(plan, bucket_index, arrays, length=length, out=out)
    if length is not None and length != plan.buckets[bucket_index].length:
        plan = _padded(plan, bucket_index, length)
    return kernels.jax_gather(plan, bucket_index, arrays, backend="cuda")


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
