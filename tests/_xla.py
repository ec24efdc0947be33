"""XLA:CPU flags the suite compiles with, in its own process and in every process a test starts.

No imports: ``tests/conftest.py`` reads this before anything imports jax.
"""

# XLA:CPU's quick code generation: LLVM at -O0 and the elemental emitters instead of the fusion
# emitters. The HLO passes, buffer assignment and collectives are the default's; only the machine
# code differs, which rounds a few last bits differently (no FMA contraction, other loop orders),
# and compiling is most of a small JAX test's time on XLA:CPU (tests/jax's four slowest files from
# an empty compilation cache: 139.6 -> 86.6 CPU-s). Processes that are compared with each other
# must compile alike, so every JAX process a test starts gets these too.
QUICK_CODEGEN = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
QUICK_CODEGEN_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in QUICK_CODEGEN.items())

# Given through XLA_FLAGS only: a program also passed them as ``compiler_options`` gets a
# compilation-cache key of its own and misses the entry the same program wrote elsewhere. XLA's own
# defaults of the two, for a test of what the default code generation computes:
# ``jax.jit(f).lower(*args).compile(DEFAULT_CODEGEN)``.
DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def host_flags(num_devices: int) -> str:
    """``XLA_FLAGS`` for a process with ``num_devices`` host CPU devices, compiling as the suite does."""
    return f"--xla_force_host_platform_device_count={num_devices} {QUICK_CODEGEN_FLAGS}"
