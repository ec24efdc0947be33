"""``python -m hybrid``: the command line, a module per command.

    plan        the bucket table and ZeRO view of a model (``plan.py``; ``_plan_pair`` for a JAX
                model through a mapping, ``_project`` for the communication at scale)
    demo        one model trained by both frontends, compared, handed over (``demo.py``)
    parity      your own torch/JAX pair trained by both frontends and compared (``parity.py``)
    checkpoint  what a checkpoint holds; converting between hybrid, torch DCP and orbax
    bench NAME  a benchmark of hybrid.bench (``bench.py``)

Each command module turns its arguments into plain values and calls library functions with them;
``argparse.Namespace`` goes no further than the command's own module (shared/STYLE.md, "From
torchrun"). ``_table`` formats the tables every command prints.
"""

from __future__ import annotations

import argparse
import os
import sys


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
    from hybrid.cli import bench, checkpoint, demo, parity, plan

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m hybrid")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"plan": plan, "demo": demo, "parity": parity, "checkpoint": checkpoint, "bench": bench}
    for command in commands.values():
        command.add_parser(sub)
    args = parser.parse_args(argv)
    return commands[args.command].run(args)
