"""Batched copy kernels: many tensors into one flat bucket (gather) and back (scatter).

One CUDA launch per launch table instead of one per tensor, with an optional fused scale (e.g.
``1 / world_size``) and dtype cast (float32 <-> bfloat16, float16). The CUDA library is built
from ``kernels/`` by ``python -m hybrid.kernels build`` (or ``make -C kernels``); without it, or
for CPU tensors, the same copies run through the reference path (torch ``_foreach_copy_`` into
views of the bucket, ``jnp.concatenate`` for JAX).

Which path runs: the ``backend`` argument, else the ``HYBRID_KERNELS`` environment variable
(``auto`` | ``cuda`` | ``reference``), else ``auto`` (the kernels for CUDA tensors when the library
is built, the reference path otherwise). ``cuda`` fails loudly when the kernels cannot run.

Cast and scale semantics, identical on both paths: ``y = dst(float32(x) * float32(scale))`` for
float32/float16/bfloat16 (round to nearest even); float64 is scaled in float64 and not cast.
"""

from hybrid.kernels._build import (BACKENDS, BUILD_DIR, GENCODE, KERNELS_DIR, LIBRARY_NAME, available, build,
                                   resolve_backend)
from hybrid.kernels._copies import gather_copies, scatter_copies
from hybrid.kernels._jax import jax_gather, jax_scatter, resolve_jax_backend
from hybrid.kernels._torch import gather, scatter

__all__ = ["BACKENDS", "BUILD_DIR", "GENCODE", "KERNELS_DIR", "LIBRARY_NAME", "available", "build", "gather",
           "gather_copies", "jax_gather", "jax_scatter", "resolve_backend", "resolve_jax_backend", "scatter",
           "scatter_copies"]
