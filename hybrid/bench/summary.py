"""``python -m hybrid bench summary FILE...``: one table of the goals from the ``--json`` files of
``bench ddp``, ``bench zero`` and ``bench jax`` run with ``--device``.

Per bench, pair and dtype: the median steps, the paired ratio with its middle half, the reference's
A/A row, whether the step meets its goal (at or under 1.00x the reference; ``noise`` where it is
above but inside the A/A's middle half), and peak memory beside it (with ZeRO3's goal: at or
under FSDP2's). ``.ci/gpu`` prints it last.
"""

from __future__ import annotations

import argparse

from hybrid.bench.gpt._report import read_json, summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench summary", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="--json files of the GPT training-step benches")
    args = parser.parse_args(argv)
    try:
        records = read_json(args.files)
    except ValueError as e:
        parser.error(str(e))
    if not records:
        parser.error(f"no records in {', '.join(args.files)}: did the benches finish a dtype?")
    print(summary(records))
    return 0
