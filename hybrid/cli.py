"""``python -m hybrid plan | demo | parity | bench NAME``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

BENCHMARKS = ("ddp", "zero", "jax", "pack", "compile", "checkpoint", "summary")


def main(argv: list[str] | None = None) -> int:
    """Run a command; a reader that stops reading (``python -m hybrid plan | head``) ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a broken pipe surfaces here, inside the try, for short outputs
        return code
    except BrokenPipeError:
        # As Unix tools do: no traceback. Point stdout at devnull so the interpreter's own flush
        # at exit does not raise again (the recipe of Python's signal module documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m hybrid")
    sub = parser.add_subparsers(dest="command", required=True)
    from hybrid import _plan_cli
    _plan_cli.add_parser(sub)
    from hybrid import _demo_cli as demo_cli
    demo_cli.add_parser(sub)
    from hybrid import _parity_cli as parity_cli
    parity_cli.add_parser(sub)
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
    if args.command == "demo":
        return demo_cli.run(args)
    if args.command == "parity":
        return parity_cli.run(args)
    return _plan_cli.run(args)
