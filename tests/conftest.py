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


import gc  # noqa: E402

import pytest  # noqa: E402 - after the environment above, which must come first

# Full garbage collections at most every 100 middle-generation ones (Python's default: 10, and
# whenever the long-lived objects grew by a quarter). A pytest worker holds a million long-lived
# objects by the end (JAX's trace and lowering caches, torch's fx graphs, every test module), and
# each full collection walks all of them: in `pytest -n 0 tests/jax`, 17 full collections took
# 4.47 s, at this threshold 5 took 1.75 s. Cycles are still freed, later; a test that needs an
# object gone calls gc.collect() itself, as those that check it do.
gc.set_threshold(700, 10, 100)


@pytest.fixture(scope="module")
def live_counter():
    """hybrid.bench._live's allocator counter, built once per module (a C++ extension); skipped,
    saying why, where no compiler can build it."""
    from hybrid.bench import _live
    try:
        _live._build()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no C++ compiler to build the allocator counter: {e}")


# The longest files first. pytest-xdist's --dist loadfile hands files to the workers in collection
# order, one more each time a worker finishes one, so a long file collected last (torch_compile/
# and torch_zero3/ sort late) leaves the other worker idle at the end of the run; started first,
# the short files fill in around them. Seconds of a clean run on 2 cores, 2026-11-28; a file not
# listed keeps its place after these, in collection order.
LONGEST_FIRST = (
    "torch_compile/test_compile_zero3.py",  # 60
    "demo/test_demo_cli.py",  # 45
    "examples/test_examples.py",  # 42
    "docs/test_docs_guides.py",  # 41
    "docs/test_docs_snippets.py",  # 30
    "torch_zero2/test_zero2_dist.py",  # 30
    "bench/test_gpt_steps.py",  # 28
    "parity/test_never_hangs.py",  # 25
    "torch_zero3/test_zero3_dist.py",  # 25
    "parity/test_harness.py",  # 23
    "jax/zero3/test_jax_offload.py",  # 23
    "checkpoint/test_jax_processes.py",  # 20
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = os.path.dirname(os.path.abspath(__file__))

    def place(item):
        return rank.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), len(LONGEST_FIRST))
    items.sort(key=place)  # stable: each file's own tests, and the other files, keep their order
