"""The statistics every benchmark prints beside its medians, and the one table that prints them.

Every benchmark times its paths interleaved (A, B, ..., A, B, ...) and reads them as ratios of
times. :func:`ratio_table` prints those ratios in one shape for all of them: the paired ratio,
the range of the per-repetition ratios, the ratio of medians, which side of 1 is better, and one
A/A row per group (the reference path against itself in the same run) that says how far from 1
noise alone moves a ratio, followed by a legend that says so in words.
"""

from __future__ import annotations

import dataclasses
import statistics
import textwrap
from collections.abc import Mapping, Sequence

from hybrid.cli._table import format_table

# How the A/A row of a benchmark is measured, for the legend.
TIMED_TWICE = "the reference path timed twice in every repetition, its second time over its first"
NEIGHBOUR_REPS = "each repetition of the reference path over the repetition before it"


def _check(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired ratio needs two equally long, non-empty series, got {len(a)} and {len(b)}")


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over repetitions of ``a[i] / b[i]``: A's time over B's in the same repetition.

    Interleaved neighbours share the host's load of the moment, so the per-repetition ratio
    cancels most of the drift that stretches both; its median is the steadier figure on a noisy
    machine than the ratio of the two medians.

    >>> paired_ratio([2.0, 4.0, 3.0], [1.0, 4.0, 2.0])
    1.5
    """
    _check(a, b)
    return statistics.median(x / y for x, y in zip(a, b))


def ratio_range(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """The middle half of the per-repetition ratios ``a[i] / b[i]``: their first and third quartiles.

    Quartiles rather than the extremes, so one repetition hit by another job does not set the
    range; with two or three repetitions they lie between the extremes and the median.

    >>> ratio_range([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5)
    (2.0, 4.0)
    >>> ratio_range([0.9, 1.1, 1.0], [1.0, 1.0, 1.0])
    (0.95, 1.05)
    """
    _check(a, b)
    ratios = [x / y for x, y in zip(a, b)]
    if len(ratios) == 1:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def rotated(order: Sequence, rep: int) -> list:
    """Repetition ``rep``'s order of the paths: ``order`` rotated by ``rep``.

    Timing the paths in one fixed order lets a position effect (the path after the heaviest one
    finds the caches cold) pass for a difference between paths, and moves an A/A ratio well off 1;
    rotating the round spreads every path over every position.

    >>> [rotated("ABC", rep) for rep in range(3)]
    [['A', 'B', 'C'], ['B', 'C', 'A'], ['C', 'A', 'B']]
    >>> rotated([], 1)  # nothing left to time (every pair failed): an empty round
    []
    """
    if not order:
        return []
    k = rep % len(order)
    return [*order[k:], *order[:k]]


def neighbour_reps(times: Sequence[float]) -> tuple[list[float], list[float]]:
    """``(later, earlier)``: each repetition and the one before it, for an A/A ratio of one series.

    For a benchmark that cannot time its reference twice per repetition: neighbouring repetitions
    are further apart in time than the paths of one repetition, so this A/A range is, if anything,
    wider than the noise of the A/B ratios.

    >>> neighbour_reps([1.0, 2.0, 4.0])
    ([2.0, 4.0], [1.0, 2.0])
    """
    if len(times) < 2:
        raise ValueError(f"an A/A ratio of neighbouring repetitions needs at least two, got {len(times)}")
    return list(times[1:]), list(times[:-1])


@dataclasses.dataclass(frozen=True)
class Ratio:
    """The time of path ``num`` over the time of path ``den``, repetition by repetition.

    ``better`` is the side of 1 the benchmark hopes for: ``"<"`` when a ratio below 1 is good news
    (``num`` faster), ``">"`` when above 1 is (``den`` faster).
    """

    num: str
    den: str
    num_times: Sequence[float]
    den_times: Sequence[float]
    better: str = "<"

    def __post_init__(self):
        if self.better not in ("<", ">"):
            raise ValueError(f"better must be '<' or '>', got {self.better!r}")
        _check(self.num_times, self.den_times)

    def reading(self) -> str:
        """Which side of 1 is better, in words: ``'< 1: hybrid faster'``."""
        return f"{self.better} 1: {self.num if self.better == '<' else self.den} faster"

    def cells(self) -> list:
        low, high = ratio_range(self.num_times, self.den_times)
        return [f"{paired_ratio(self.num_times, self.den_times):.3f}", f"{low:.3f}-{high:.3f}",
                f"{statistics.median(self.num_times) / statistics.median(self.den_times):.3f}"]


def ratio_table(groups: Mapping[str, tuple[Sequence[Ratio], Ratio | None]], *, noise: str = TIMED_TWICE,
                group: str = "measured") -> str:
    """The benchmark's ratios, one A/A row per group, and the legend: the shape every bench prints.

    Args:
      groups: per group (a model, a workload), its A/B ratios and its A/A ratio (the reference
        path against itself: ``Ratio("torch'", "torch", second_times, first_times)``), or ``None``
        where the run has too few repetitions for one.
      noise: how the A/A row was measured (:data:`TIMED_TWICE` or :data:`NEIGHBOUR_REPS`).
      group: the header of the group column.

    >>> ab = Ratio("hybrid", "torch", [0.9, 1.0, 0.8], [1.0, 1.0, 1.0])
    >>> aa = Ratio("torch'", "torch", [1.0, 1.1, 0.9], [1.0, 1.0, 1.0])
    >>> print(*ratio_table({"mlp": ([ab], aa)}).splitlines()[:4], sep=chr(10))
    measured  ratio of times            paired  middle half  of medians  better
    --------  ------------------------  ------  -----------  ----------  ------------------
    mlp       hybrid/torch              0.900   0.850-0.950  0.900       < 1: hybrid faster
    mlp       A/A (noise) torch'/torch  1.000   0.950-1.050  1.000       1 = no noise
    """
    rows = []
    for name, (ratios, same) in groups.items():
        rows += [[name, f"{r.num}/{r.den}", *r.cells(), r.reading()] for r in ratios]
        if same is None:
            rows.append([name, "A/A (noise)", "n/a", "", "", "needs more repetitions"])
        else:
            rows.append([name, f"A/A (noise) {same.num}/{same.den}", *same.cells(), "1 = no noise"])
    table = format_table([group, "ratio of times", "paired", "middle half", "of medians", "better"], rows)
    legend = [
        "paired: the median over the repetitions of one path's time over the other's in the same repetition",
        "  (neighbours in the interleaved order, which rotates every repetition: a change in the machine's",
        "  load stretches both, and no path keeps the same position);",
        "  middle half: first to third quartile of those per-repetition ratios; of medians: median / median.",
        *textwrap.wrap(f"A/A (noise): the same path against itself in this run ({noise}). An A/B ratio "
                       "inside its group's A/A middle half cannot be told from noise.", 100, subsequent_indent="  "),
    ]
    return table + "\n" + "\n".join(legend)
