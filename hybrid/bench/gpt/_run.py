"""The GPT training-step benches end to end, as ``bench ddp | zero | jax --device D`` run them:
check the device (a usage error naming what is missing), measure, print, write the records."""

from __future__ import annotations

import argparse
import dataclasses

from hybrid.bench.gpt import _report
from hybrid.bench.gpt._config import LR, StepBench
from hybrid.bench.gpt._device import jax_devices, torch_ranks

STEP = "step = forward + loss + backward + optimizer step + zero_grad, timed to the device's end"


def num_tensors(bench: StepBench) -> int:
    """Parameter tensors of the torch model, counted on the meta device (nothing allocated).

    >>> num_tensors(StepBench("cpu"))  # GPT-2 small: 2 embeddings, 12 blocks of 12, ln_f's 2
    148
    """
    import torch

    from hybrid.models import TorchGPT
    with torch.device("meta"):
        return len(list(TorchGPT(bench.gpt).parameters()))


def _model_line(bench: StepBench, ranks_word: str) -> str:
    return (f"GPT {bench.model}: {bench.gpt.num_params():,} parameters in {num_tensors(bench)} tensors, "
            f"batch {bench.batch} x {bench.seq} tokens per {ranks_word}, AdamW lr {LR:g}")


def torch_main(parser: argparse.ArgumentParser, bench: StepBench, bench_name: str, pairs) -> int:
    """``bench ddp`` / ``bench zero`` with ``--device``: ``pairs`` of (hybrid, torch) variants."""
    from hybrid.bench.gpt import _torch
    try:
        bench = dataclasses.replace(bench, ranks=torch_ranks(bench.device, bench.ranks))
    except ValueError as e:
        parser.error(str(e))
    results = _torch.run(bench, pairs, bench_name)  # rank 0 wrote the records (--json) as it went
    env = _torch.environment()
    where = _torch.where(bench, results[0]["device"])
    facts = {name: f for res in results[0]["dtypes"].values() for name, f in res["facts"].items() if f}
    print(f"bench {bench_name} --device {bench.device}: {_model_line(bench, 'rank')}")
    cuda = f" (CUDA {env['cuda']}, NCCL {env['nccl']})" if bench.device == "cuda" else ""
    print(f"{where}; torch {env['torch']}{cuda}, float32 matmuls TF32 {'on' if env['tf32 matmul'] else 'off'}")
    for name, f in facts.items():
        kernels = "" if "kernels" not in f else (", bucket copies by the CUDA kernels" if f["kernels"]
                                                 else ", bucket copies by torch (no kernels)")
        print(f"{name}: {f['buckets']} buckets{kernels}")
    print(f"{STEP}; medians of {bench.reps} interleaved rounds after {bench.warmup} (rank 0); memory: the "
          "largest rank, counted from the bytes live before the variant was built")
    print(_report.measured(results, pairs))
    return 0


def jax_main(parser: argparse.ArgumentParser, bench: StepBench, copy_backend: str | None) -> int:
    """``bench jax --device D``: stages 1-3 against unsharded optax, each dtype printed (and its
    records written) as soon as it is measured."""
    from hybrid.bench.gpt import _jax
    try:
        devices = jax_devices(bench.device, bench.ranks)
    except ValueError as e:
        parser.error(str(e))
    bench = dataclasses.replace(bench, ranks=len(devices))
    env = _jax.environment(devices, copy_backend)
    where = f"{bench.model}, {env['devices']}"
    print(f"bench jax --device {bench.device}: {_model_line(bench, 'device')}")
    print(f"{where}; jax {env['jax']}, bucket copies by {env['copies']}, matmul precision {env['matmul precision']}")
    print(f"{STEP}; medians of {bench.reps} interleaved rounds after {bench.warmup}; memory per device: held "
          "between steps, peak as XLA planned the compiled step")
    recs = []

    def on_dtype(dtype, result):
        done = {"dtypes": {dtype: result["dtypes"][dtype]}}
        print(_report.measured([done], _jax.PAIRS), flush=True)
        recs.extend(_report.records("jax", where, [done], _jax.PAIRS, memory="XLA plan"))
        if bench.json:
            _report.write_json(bench.json, recs)

    _jax.measure(bench, devices, copy_backend=copy_backend, on_dtype=on_dtype)
    return 0
