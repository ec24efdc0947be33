"""Streams of collectives issued back to back, and two streams (compute, communication) that wait
on each other: when each task ends.

A collective issued right behind another overlaps it on a backend with more than one worker (gloo
runs two threads per group; a train never returns to Python between them), so one more
collective adds its *gap* (:meth:`hybrid.core.CostModel.gap`, measured in trains of one size), not
its isolated time: it hides ``seconds - gap`` of itself behind the one before. Behind a *small*
collective it hides less, ``seconds - gap_after_small`` (:meth:`hybrid.core.CostModel.gap_after_small`,
measured in trains that alternate it with the smallest size, which takes ``small_s``), and each
second its predecessor takes beyond ``small_s`` hides one more second, up to the same-size gap: a
collective cannot hide behind more than there is before it.

Why: on gloo, 3 ranks with a core each (a lent 16-core host, 2026-11-26), a train alternating
four 4.5-12 MiB all-reduces with four tiny ones took 15.7 ms, where the big ones' same-size gaps
sum to 12.5 ms and their isolated times to 16.1 ms (docs/core.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def next_end(last_end: float, previous_s: float, ready: float, seconds: float, gap: float,
             after_small: float | None = None, small_s: float | None = None) -> float:
    """When a collective of the stream ends: issued at ``ready``, taking ``seconds`` alone, behind
    one that took ``previous_s`` alone (``math.inf`` for none) and ended at ``last_end``.

    Behind one at least as long as itself it adds ``gap``; behind one of ``small_s`` or less,
    ``after_small`` (default ``gap``: the predecessor does not matter); in between, each second of
    the predecessor's beyond ``small_s`` hides one more second of it, up to the gap.

    >>> next_end(1.0, 1.0, 0.0, 1.0, 0.25, 0.875, 0.125)  # behind its own size: its gap
    1.25
    >>> next_end(1.0, 0.125, 0.0, 1.0, 0.25, 0.875, 0.125)  # behind a small one
    1.875
    >>> next_end(1.0, 0.375, 0.0, 1.0, 0.25, 0.875, 0.125)  # behind one 0.25 longer: 0.25 more hidden
    1.625
    """
    if (after_small is None) != (small_s is None):
        raise ValueError(f"a collective's gap after a small one needs the small one's time too (both or neither), "
                         f"got after_small={after_small!r}, small_s={small_s!r}")
    hidden = seconds - gap
    if after_small is not None and previous_s < seconds:
        hidden = min(hidden, seconds - after_small + max(0.0, previous_s - small_s))
    return max(ready + seconds, last_end + seconds - hidden)


def stream_ends(tasks: Iterable[tuple]) -> list[float]:
    """When each collective of a stream ends, issued in order: ``(ready_s, seconds, gap_s)`` each,
    or ``(ready_s, seconds, gap_s, gap_after_small_s, small_s)`` (:meth:`CostModel.train_gaps`).

    A collective ends no sooner than ``seconds`` after it is issued (at ``ready_s``), and no sooner
    than its gap after the one before it ends (:func:`next_end`: the gap it has behind the one it
    follows). With ``gap == seconds`` that is a serial stream (each starts when the previous
    ends); a smaller gap is a stream that overlaps consecutive collectives.

    >>> stream_ends([(0.0, 1.0, 1.0), (0.0, 1.0, 1.0)])  # serial
    [1.0, 2.0]
    >>> stream_ends([(0.0, 1.0, 0.25), (0.0, 1.0, 0.25), (5.0, 1.0, 0.25)])  # a train, then one alone
    [1.0, 1.25, 6.0]
    >>> stream_ends([(0.0, 1.0, 0.25, 0.75, 0.125), (0.0, 0.125, 0.125), (0.0, 1.0, 0.25, 0.75, 0.125)])
    [1.0, 1.125, 1.875]
    """
    ends, last, previous = [], -math.inf, math.inf
    for ready, seconds, *gaps in tasks:
        last = next_end(last, previous, ready, seconds, *gaps)
        ends.append(last)
        previous = seconds
    return ends


def exposed_seconds(compute: Sequence[tuple[str, float, Sequence[str]]],
                    comm: Sequence[tuple]) -> tuple[float, float]:
    """Run two streams, compute and communication, each in its own issue order; a task starts
    when its stream is free and the tasks it names are done. Returns ``(end, exposed)``: when
    the last task ends, and how much of that is communication the compute did not hide.

    A communication task may carry, after its dependencies, its gaps as a :func:`stream_ends` task
    does: it then ends as there, a stream that overlaps consecutive collectives.

    >>> exposed_seconds([("b0", 1.0, ()), ("b1", 1.0, ())], [("r0", 1.5, ("b0",)), ("r1", 0.5, ("b1",))])
    (3.0, 1.0)
    """
    done: dict[str, float] = {}
    queues = [list(compute), list(comm)]
    free = [0.0, 0.0]
    previous = [math.inf, math.inf]  # per stream, the last task's time alone
    while queues[0] or queues[1]:
        progressed = False
        for s, queue in enumerate(queues):
            while queue and all(d in done for d in queue[0][2]):
                name, seconds, deps, *gaps = queue.pop(0)
                ready = max([0.0, *(done[d] for d in deps)])
                # without a gap: max(ready, free) + seconds, a serial stream
                free[s] = done[name] = next_end(free[s], previous[s], ready, seconds, *(gaps or [seconds]))
                previous[s] = seconds
                progressed = True
        if not progressed:
            waiting = [q[0][0] for q in queues if q]
            raise ValueError(f"the tasks wait on each other or on unknown names: {waiting}")
    end = max(free)
    return end, end - sum(t[1] for t in compute)
