"""What a GPT training-step bench prints, the goal records it writes (``--json``), and the one
table ``bench summary`` makes of them.

A run's results are per rank (JAX: one): ``{"dtypes": {dtype: {"times": {variant: [s, ...]},
"memory": {variant: {"held": bytes, "peak": bytes}}, "failed": {variant: error}}}}``, the
reference of each pair timed a second time in every round under its name with a ``'`` (the A/A).
Times are rank 0's, memory the largest over the ranks; a pair with a failed variant is reported
as failed, with the error.
"""

from __future__ import annotations

import json
import os
import statistics

from hybrid.cli._table import format_table, human_bytes
from hybrid.bench._stats import Ratio, ratio_table

# The issue's goals: every pair's step at or under 1.00x its reference; ZeRO3's peak memory at or
# under FSDP2's too.
TIME_GOAL = 1.00
MEMORY_GOALS = {"hybrid_zero3"}


def _by_reference(pairs) -> dict[str, list[str]]:
    """The pairs grouped by their reference, in order: ``{reference: [ours, ...]}``.

    >>> _by_reference([("zero1", "optax"), ("zero2", "optax"), ("zero3", "fsdp2")])
    {'optax': ['zero1', 'zero2'], 'fsdp2': ['zero3']}
    """
    groups: dict[str, list[str]] = {}
    for ours, ref in pairs:
        groups.setdefault(ref, []).append(ours)
    return groups


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else human_bytes(n)


def _over(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.3f}"


def _failed(results: list[dict], dtype: str) -> dict[str, str]:
    """The variants that failed on any rank, and the first rank's error of each."""
    failed: dict[str, str] = {}
    for r in results:
        for name, error in r["dtypes"][dtype].get("failed", {}).items():
            failed.setdefault(name, error)
    return failed


def _measured_pairs(pairs, failed) -> list[tuple[str, str]]:
    return [pair for pair in pairs if not set(pair) & set(failed)]


def _memory(results: list[dict], dtype: str, name: str, what: str) -> int | None:
    return max((r["dtypes"][dtype]["memory"][name][what] for r in results), default=None)


def measured(results: list[dict], pairs) -> str:
    """Per dtype and variant: the median step, its ratio to its reference, memory held and at the
    step's peak (the largest rank), its ratio to the reference's; then the ratio table, a group per
    (dtype, reference) with the reference's A/A row; then what failed."""
    rows, groups, errors = [], {}, []
    for dtype, res in results[0]["dtypes"].items():
        times, failed = res["times"], _failed(results, dtype)
        errors += [f"FAILED {dtype} {name}: {error}" for name, error in failed.items()]
        peak = lambda name: _memory(results, dtype, name, "peak")  # noqa: E731
        for ref, ours in _by_reference(_measured_pairs(pairs, failed)).items():
            for name in (ref, *ours):
                med = statistics.median(times[name])
                rows.append([dtype, name, f"{med * 1e3:.2f}", _over(med, statistics.median(times[ref])),
                             _bytes(_memory(results, dtype, name, "held")), _bytes(peak(name)),
                             _over(peak(name), peak(ref))])
            groups[f"{dtype}, {ref}"] = ([Ratio(name, ref, times[name], times[ref]) for name in ours],
                                         Ratio(ref + "'", ref, times[ref + "'"], times[ref]))
    parts = []
    if rows:
        parts += [format_table(["dtype", "variant", "ms", "/ ref (medians)", "held", "peak in a step", "peak / ref"],
                               rows), "", ratio_table(groups, group="dtype, reference")]
    return "\n".join(parts + errors)


def records(bench_name: str, where: str, results: list[dict], pairs, *, memory: str) -> list[dict]:
    """One goal record per (dtype, pair): the raw series and peaks, for ``bench summary``; a
    failed pair's record holds its error instead."""
    out = []
    for dtype, res in results[0]["dtypes"].items():
        times, failed = res["times"], _failed(results, dtype)
        for ours, ref in pairs:
            rec = {"bench": bench_name, "where": where, "dtype": dtype, "ours": ours, "reference": ref,
                   "memory": memory, "memory_goal": ours in MEMORY_GOALS}
            errors = [f"{name}: {failed[name]}" for name in (ours, ref) if name in failed]
            if errors:
                rec["failed"] = "; ".join(errors)
            else:
                rec.update(ours_s=times[ours], reference_s=times[ref], again_s=times[ref + "'"],
                           ours_peak=_memory(results, dtype, ours, "peak"),
                           reference_peak=_memory(results, dtype, ref, "peak"))
            out.append(rec)
    return out


def write_json(path: str, recs: list[dict]) -> None:
    """``recs`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"records": recs}, f, indent=1)
    os.replace(tmp, path)


def read_json(paths: list[str]) -> list[dict]:
    """The records of every file; a ValueError naming a file that is not a bench's ``--json``."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                recs = json.load(f)["records"]
            if not isinstance(recs, list) or not all(isinstance(r, dict) and "bench" in r for r in recs):
                raise ValueError("its records are not a list of bench records")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not the --json of a GPT training-step bench ({type(e).__name__}: {e})") from None
        out += recs
    return out


def _verdict(ratio: Ratio, same: Ratio) -> str:
    """``yes`` at or under the goal; ``noise`` above it but inside the A/A's middle half (a
    difference this run cannot tell from noise); ``no`` above both."""
    paired = float(ratio.cells()[0])
    if paired <= TIME_GOAL:
        return "yes"
    return "noise" if paired <= float(same.cells()[1].split("-")[1]) else "no"


def _row(r: dict) -> list[str]:
    pair = [r["bench"], f"{r['ours']}/{r['reference']}", r["dtype"]]
    if "failed" in r:
        return pair + ["", "", "", "FAILED", "", ""]
    ratio = Ratio(r["ours"], r["reference"], r["ours_s"], r["reference_s"])
    same = Ratio(r["reference"] + "'", r["reference"], r["again_s"], r["reference_s"])
    (paired, middle, _), (aa, aa_middle, _) = ratio.cells(), same.cells()
    med = [statistics.median(r[k]) * 1e3 for k in ("ours_s", "reference_s")]
    mem = _over(r["ours_peak"], r["reference_peak"])
    return pair + [f"{med[0]:.2f} / {med[1]:.2f}", f"{paired} ({middle})", f"{aa} ({aa_middle})",
                   _verdict(ratio, same), f"{_bytes(r['ours_peak'])} / {_bytes(r['reference_peak'])} ({mem})",
                   ("n/a" if mem == "n/a" else "yes" if float(mem) <= 1 else "no") if r["memory_goal"] else "-"]


def summary(recs: list[dict]) -> str:
    """The one table of the goals: per bench, pair and dtype, the step ratio (paired, its middle
    half), the reference's A/A, whether the time goal is met, and peak memory beside it.

    >>> rec = {"bench": "ddp", "where": "gpt2-small, 1 rank, H100", "dtype": "bf16", "ours": "hybrid_ddp",
    ...        "reference": "torch_ddp", "ours_s": [0.099, 0.1, 0.101], "reference_s": [0.1] * 3,
    ...        "again_s": [0.1, 0.102, 0.098], "ours_peak": 9 << 30, "reference_peak": 10 << 30,
    ...        "memory": "max_memory_allocated", "memory_goal": False}
    >>> import re
    >>> re.split(r" {2,}", summary([rec]).splitlines()[2])
    ['ddp', 'hybrid_ddp/torch_ddp', 'bf16', '100.00 / 100.00', '1.000 (0.995-1.005)', '1.000 (0.990-1.010)', 'yes', '9.00 GiB / 10.00 GiB (0.900)', '-']
    """
    first = {}  # rows by bench, then pair, in the order they first appear; dtypes as measured
    for i, r in enumerate(recs):
        first.setdefault(r["bench"], i)
        first.setdefault((r["bench"], r["ours"]), i)
    ordered = sorted(recs, key=lambda r: (first[r["bench"]], first[r["bench"], r["ours"]]))
    table = format_table(["bench", "ours/reference", "dtype", "ms (medians)", "step paired (middle half)",
                          "A/A reference", f"<= {TIME_GOAL:.2f}", "peak memory", "peak <= ref"],
                         [_row(r) for r in ordered])
    legend = ["runs: " + "; ".join(f"{r['bench']}: {r['where']}" for r in {r["bench"]: r for r in recs}.values()),
              f"<= {TIME_GOAL:.2f}: yes at or under the goal; noise: above it, but inside the reference's A/A middle",
              "  half (this run cannot tell it from noise); no: above both.",
              "peak memory: torch: the allocator's peak over a step (CUDA's max_memory_allocated; on the CPU,",
              "  hybrid.bench._live), the largest rank; jax: XLA's plan of the compiled step (arguments + outputs",
              "  not donated + temporaries). Its goal (peak <= ref) is hybrid_zero3's against fsdp2 only."]
    legend += [f"FAILED {r['bench']} {r['dtype']} {r['ours']}/{r['reference']}: {r['failed']}"
               for r in ordered if "failed" in r]
    return table + "\n" + "\n".join(legend)
