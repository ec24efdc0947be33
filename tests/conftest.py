"""Numerics every test relies on, pinned before any framework is imported."""

import os

# Four host CPU devices for JAX multi-device tests, compiled with XLA:CPU's quick code generation
# (tests/_xla.py says why); must be set before jax is first imported.
from tests._xla import host_flags  # noqa: E402 - imports nothing

os.environ.setdefault("XLA_FLAGS", host_flags(4))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Exact float32 matmuls on CPU so that comparisons against the oracles are meaningful.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One JAX compilation cache for the whole run, on disk so that the pytest workers and every
# process a test starts (docs pages, jax.distributed jobs, examples) share it: many tests compile
# the same programs (the same model, step and stage in a new closure), and on XLA:CPU compiling is
# most of a small JAX test's time (tests/jax: 192 s without, 144 s with, from an empty cache). Keyed
# by the HLO, the compile options and the jax version, so an entry is never stale; under the
# gitignored .pytest_cache, so a clean clone starts with none.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   ".pytest_cache", "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


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
