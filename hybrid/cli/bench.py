"""``python -m hybrid bench NAME [ARGS]``: a benchmark of ``hybrid.bench``, given its own arguments.

Each benchmark (``hybrid.bench.NAME``) parses the rest of the command line itself (``--help``
lists its options) and measures two paths interleaved in one run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = ("ddp", "zero", "jax", "pack", "compile", "checkpoint", "summary")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS))
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(bench_parser=p)
    return p


def run(args) -> int:
    return run_benchmark(args.name, args.args, error=args.bench_parser.error)


def run_benchmark(name: str, argv: list[str], *, error=None) -> int:
    """``hybrid.bench.NAME.main(argv)``; a benchmark not built yet is a usage error."""
    try:
        module = importlib.import_module(f"hybrid.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"hybrid.bench.{name}" and error is not None:
            error(f"benchmark {name!r} is not implemented yet")
        raise
    return module.main(argv)
