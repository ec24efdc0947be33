"""GPT training steps on a device: ``bench ddp``, ``bench zero`` and ``bench jax`` with ``--device``.

hybrid's DDP, ZeRO-1 and ZeRO3 against torch's DDP, ZeroRedundancyOptimizer and FSDP2, and
``hybrid.jax.zero`` stages 1-3 against unsharded optax, on a GPT (GPT-2 small by default), in
float32 and under bf16: step times paired in one run with an A/A row, peak memory beside them, and
goal records (``--json``) that ``bench summary`` turns into one table. ``--device cuda`` is NCCL
ranks, one per GPU (JAX: its GPU devices); ``--device cpu`` runs the same code on gloo ranks and
host devices. See docs/benchmarks/gpu.md, "GPT-2 small on a GPU".
"""

from hybrid.bench.gpt._config import DTYPES, StepBench, add_arguments, config_from_args
from hybrid.bench.gpt._run import jax_main, torch_main

__all__ = ["DTYPES", "StepBench", "add_arguments", "config_from_args", "jax_main", "torch_main"]
