"""Bucketed all-reduce: DDP's gradient buckets as an optax transform, one collective per bucket."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.jax._copy import check_backend, pack_bucket, unpack_bucket, use_kernels
from hybrid.jax._specs import _Layout, axis_size, check_caps


def _reduce(flat, axis_name):
    # The one collective per bucket (a module function so tests can watch the buffers it sends).
    return jax.lax.psum(flat, axis_name)


def bucketed_all_reduce(axis_name, *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                        first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
                        mean: bool = True, order: Sequence[str] | None = None,
                        copy_backend: str | None = None) -> optax.GradientTransformation:
    """Sum (or average) per-device gradients over ``axis_name``, one collective per bucket.

    Gradients are packed into the flat buckets of ``hybrid.core.plan_buckets`` (the same buckets
    torch's DDP builds for the same names, shapes and caps), each bucket is reduced with one
    ``lax.psum``, and the result is unpacked into the tree. The updates must be *per-device*
    gradients: see :func:`hybrid.jax.local_grad` for why ``jax.grad`` inside ``shard_map`` does
    not give those.

    Args:
      axis_name: the mesh (``shard_map``) or ``pmap`` axis to reduce over.
      bucket_cap_bytes / first_bucket_cap_bytes: DDP's bucket caps.
      mean: divide by the axis size (DDP's average) instead of summing.
      order: leaf names in registration order (see :func:`hybrid.jax.specs`).
      copy_backend: how buckets are filled and emptied: ``"auto"`` (``hybrid.kernels``' CUDA
        kernels when JAX runs on a GPU and the library is built, ``hybrid.core.pack`` / ``unpack``
        otherwise), ``"cuda"`` or ``"reference"`` to force one; default ``$HYBRID_KERNELS`` or auto.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> tx = bucketed_all_reduce("dp")
    >>> g = {"w": jnp.arange(4.0).reshape(4, 1)}
    >>> out, _ = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name="dp")(g)
    >>> np.asarray(out["w"][0]).tolist()
    [1.5]
    """
    check_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    check_backend(copy_backend)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name, "bucketed_all_reduce")
        layout = _Layout.of(updates, what="bucketed_all_reduce", order=order,
                            bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)
        arrays = layout.spec_arrays(updates)
        cuda = use_kernels(copy_backend)
        out = {}
        for b in range(layout.plan.num_buckets):
            flat = _reduce(pack_bucket(layout.plan, b, arrays, cuda=cuda), axis_name)
            # The mean's divide comes after the sum, on the way out of the bucket: XLA fuses it
            # (and the unpacking slices) into the consumers of each leaf, the kernel into its copy,
            # so it costs no pass over the bucket of its own.
            out.update(unpack_bucket(layout.plan, b, flat, divisor=n if mean else None, cuda=cuda))
        return layout.unflatten(out), state

    return optax.GradientTransformation(init_fn, update_fn)
