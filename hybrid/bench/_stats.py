"""The statistics every benchmark prints beside its medians."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over repetitions of ``a[i] / b[i]``: A's time over B's in the same repetition.

    Interleaved neighbours share the host's load of the moment, so the per-repetition ratio
    cancels most of the drift that stretches both; its median is the steadier figure on a noisy
    machine than the ratio of the two medians.

    >>> paired_ratio([2.0, 4.0, 3.0], [1.0, 4.0, 2.0])
    1.5
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equally long, non-empty series, got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))
