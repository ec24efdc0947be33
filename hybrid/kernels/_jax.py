"""The JAX side: the XLA FFI targets (registered lazily for CUDA) and ``jax_gather`` /
``jax_scatter``, which fall back to ``jnp`` copies where the kernels cannot run."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hybrid.core import BucketPlan, canonical_dtype
from hybrid.kernels import _build
from hybrid.kernels._build import resolve_backend
from hybrid.kernels._copies import _check_cast, _members


@functools.cache
def _register_ffi() -> None:
    import jax
    lib = _build._library()
    jax.ffi.register_ffi_target("hybrid_gather", jax.ffi.pycapsule(lib.HybridGather), platform="CUDA")
    jax.ffi.register_ffi_target("hybrid_scatter", jax.ffi.pycapsule(lib.HybridScatter), platform="CUDA")


def resolve_jax_backend(backend: str | None) -> str:
    """:func:`resolve_backend` for JAX arrays: on CUDA when JAX's default backend is a GPU.

    >>> resolve_jax_backend("reference")
    'reference'
    """
    import jax
    return resolve_backend(backend, on_cuda=jax.default_backend() == "gpu")


def _jax_scaled(x, dtype, scale):
    import jax.numpy as jnp
    if scale is None:
        return x.astype(dtype)
    compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return (x.astype(compute) * jnp.asarray(scale, compute)).astype(dtype)


def jax_gather(plan: BucketPlan, bucket_index: int, arrays: Sequence, *, scale: float | None = None,
               out_dtype=None, backend: str | None = None):
    """:func:`gather` for JAX arrays (usable under ``jit``): the XLA FFI kernel on GPU, else
    ``jnp.concatenate``.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> jax_gather(plan, 0, [jnp.ones(2), jnp.full((1, 2), 3.0)], out_dtype="bfloat16").tolist()
    [1.0, 1.0, 3.0, 3.0]
    """
    import jax
    import jax.numpy as jnp
    members = _members(plan, bucket_index, arrays, "jax_gather")
    bucket = plan.buckets[bucket_index]
    dtype = jnp.dtype(members[0].dtype if out_dtype is None else out_dtype)
    _check_cast(bucket.dtype, canonical_dtype(dtype), scale)
    if resolve_jax_backend(backend) == "cuda":
        _register_ffi()
        call = jax.ffi.ffi_call("hybrid_gather", jax.ShapeDtypeStruct((bucket.length,), dtype))
        return call(*members, offsets=np.asarray(bucket.offsets, np.int64),
                    scale=np.float64(1.0 if scale is None else scale), has_scale=np.int32(scale is not None))
    parts, end = [], 0
    for a, o in zip(members, bucket.offsets):
        if o > end:
            parts.append(jnp.zeros(o - end, dtype))
        parts.append(_jax_scaled(a.reshape(-1), dtype, scale))
        end = o + a.size
    if bucket.length > end:
        parts.append(jnp.zeros(bucket.length - end, dtype))
    return jnp.concatenate(parts)


def jax_scatter(plan: BucketPlan, bucket_index: int, flat, *, scale: float | None = None, out_dtype=None,
                backend: str | None = None) -> dict[int, object]:
    """:func:`scatter` for JAX arrays: ``{spec_index: array}`` of the specs' shapes.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> {k: v.tolist() for k, v in jax_scatter(plan, 0, jnp.arange(4.0), scale=2.0).items()}
    {0: [0.0, 2.0], 1: [[4.0, 6.0]]}
    """
    import jax
    import jax.numpy as jnp
    if not 0 <= bucket_index < len(plan.buckets):
        raise ValueError(f"bucket_index {bucket_index} out of range for {len(plan.buckets)} buckets")
    bucket = plan.buckets[bucket_index]
    if flat.ndim != 1 or flat.shape[0] < bucket.length:
        raise ValueError(f"bucket {bucket_index} needs a 1-D array of at least {bucket.length} elements, "
                         f"got shape {tuple(flat.shape)}")
    dtype = jnp.dtype(flat.dtype if out_dtype is None else out_dtype)
    _check_cast(canonical_dtype(flat.dtype), canonical_dtype(dtype), scale)
    shapes = [plan.specs[m].shape for m in bucket.members]
    if resolve_jax_backend(backend) == "cuda":
        _register_ffi()
        call = jax.ffi.ffi_call("hybrid_scatter", [jax.ShapeDtypeStruct(s, dtype) for s in shapes])
        outs = call(flat, offsets=np.asarray(bucket.offsets, np.int64),
                    scale=np.float64(1.0 if scale is None else scale), has_scale=np.int32(scale is not None))
        return dict(zip(bucket.members, outs))
    return {m: _jax_scaled(flat[o:o + n], dtype, scale).reshape(s)
            for m, o, n, s in zip(bucket.members, bucket.offsets, bucket.numels, shapes)}
