"""``python -m hybrid plan | bench NAME``."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = ("ddp", "zero", "jax", "pack", "compile")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m hybrid")
    sub = parser.add_subparsers(dest="command", required=True)
    from hybrid import _plan_cli
    _plan_cli.add_parser(sub)
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS))
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            module = importlib.import_module(f"hybrid.bench.{args.name}")
        except ModuleNotFoundError as e:
            if e.name == f"hybrid.bench.{args.name}":
                parser.error(f"benchmark {args.name!r} is not implemented yet")
            raise
        return module.main(args.args)
    return _plan_cli.run(args)
