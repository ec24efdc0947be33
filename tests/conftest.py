"""Numerics every test relies on, pinned before any framework is imported."""

import os

# Four host CPU devices for JAX multi-device tests; must be set before jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Exact float32 matmuls on CPU so that comparisons against the oracles are meaningful.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


import pytest  # noqa: E402 - after the environment above, which must come first


@pytest.fixture(scope="module")
def live_counter():
    """hybrid.bench._live's allocator counter, built once per module (a C++ extension); skipped,
    saying why, where no compiler can build it."""
    from hybrid.bench import _live
    try:
        _live._build()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no C++ compiler to build the allocator counter: {e}")
