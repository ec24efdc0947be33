"""Numerics every test relies on, pinned before any framework is imported."""

import os

# Four host CPU devices for JAX multi-device tests; must be set before jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Exact float32 matmuls on CPU so that comparisons against the oracles are meaningful.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
