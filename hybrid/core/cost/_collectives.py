"""What collectives cost: the textbook latency-bandwidth (Hockney) model, fitted to measurements.

A message of ``n`` bytes over one link costs ``alpha + n / bandwidth``. A collective over ``p``
ranks is a number of such steps, by algorithm (Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", 2005; NCCL's ring and tree):

============== ============================== ==========================
collective     ring                           tree
============== ============================== ==========================
all-reduce     2 (p-1) alpha + 2 (p-1)/p n/B   2 log2(p) alpha + 2 n/B
reduce-scatter (p-1) alpha + (p-1)/p n/B       (ring only)
all-gather     (p-1) alpha + (p-1)/p n/B       (ring only)
broadcast      (p-1) alpha + n/B (pipelined)   log2(p) (alpha + n/B)
============== ============================== ==========================

``n`` is the full buffer (all-reduce, broadcast), the gathered output (all-gather) or the
reduce-scatter input. A :class:`CostModel` holds, per collective, the line ``t = a + b n``
measured over one process group: it predicts that group directly, and through the formulas
(``alpha = a / steps``, ``1/B = b / volume``) projects the same link to other world sizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence

import numpy as np

from hybrid.core._fingerprint import fingerprint_of

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# What the frontends' measure_collectives time by default: 4 KiB to 32 MiB, from latency-bound to
# bandwidth-bound, dense where buckets fall (torch's caps are 1 and 25 MiB). 256 KiB: between 64
# KiB and 1 MiB a gloo all-reduce at 3 ranks on 2 cores is no line (a 412 KiB one, interpolated
# from those two, was predicted at twice its time).
PROBE_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 25)
ALGORITHMS = ("ring", "tree")


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """A network as the model sees it: per-message latency and per-rank bandwidth."""

    name: str
    latency_s: float
    bytes_per_s: float

    def __post_init__(self):
        if not (self.latency_s >= 0 and self.bytes_per_s > 0):
            raise ValueError(f"link {self.name!r} needs latency >= 0 and bandwidth > 0, "
                             f"got {self.latency_s} s and {self.bytes_per_s} B/s")


# Named networks for projections (stated assumptions, per rank, one direction):
# NVLink-class: H100 NVLink 4 (450 GB/s per direction, ~370 GB/s reached by NCCL), ~3 us;
# 400 Gb/s InfiniBand (NDR, 50 GB/s, ~45 reached), ~5 us across a switch;
# 100 GbE (12.5 GB/s, ~11 reached over RoCE/TCP), ~25 us.
NETWORKS = {
    "nvlink": Link("NVLink-class (370 GB/s, 3 us)", 3e-6, 370e9),
    "ib400": Link("400 Gb/s InfiniBand (45 GB/s, 5 us)", 5e-6, 45e9),
    "eth100": Link("100 GbE (11 GB/s, 25 us)", 25e-6, 11e9),
}


def _steps_and_volume(kind: str, world_size: int, algorithm: str) -> tuple[float, float]:
    """``(latency steps, bandwidth factor)``: the collective costs ``steps * alpha + factor * n / B``."""
    p = world_size
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {ALGORITHMS}")
    if p == 1:
        return 0.0, 0.0
    log_p = math.ceil(math.log2(p))
    if kind == "all_reduce":
        return (2 * log_p, 2.0) if algorithm == "tree" else (2 * (p - 1), 2 * (p - 1) / p)
    if kind == "broadcast":
        return (log_p, log_p) if algorithm == "tree" else (p - 1, 1.0)
    return p - 1, (p - 1) / p  # reduce-scatter and all-gather: ring


def collective_seconds(kind: str, nbytes: float, world_size: int, link: Link, algorithm: str | None = None) -> float:
    """Time of one collective on ``link``; ``algorithm=None`` takes the faster of ring and tree,
    as NCCL's tuner does.

    >>> link = Link("test", 1e-5, 1e9)
    >>> round(collective_seconds("all_reduce", 1e6, 4, link, "ring") * 1e6)  # 6 alpha + 1.5 n / B
    1560
    >>> collective_seconds("all_reduce", 1e6, 1, link)
    0.0
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    options = ALGORITHMS if algorithm is None else (algorithm,)
    best = math.inf
    for a in options:
        steps, factor = _steps_and_volume(kind, world_size, a)
        best = min(best, steps * link.latency_s + factor * nbytes / link.bytes_per_s)
    return best


def wire_bytes(kind: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in one ring collective (a broadcast: the average over ranks).

    >>> wire_bytes("all_reduce", 100, 4)
    150.0
    """
    return _steps_and_volume(kind, world_size, "ring")[1] * nbytes if kind != "broadcast" else (
        nbytes * (world_size - 1) / world_size)


def _interpolate(sizes: Sequence[float], times: Sequence[float], nbytes: float) -> float:
    """Between measured sizes, the measured times interpolated; beyond the largest, the last two
    times' slope; below the smallest, its time (the latency floor)."""
    if nbytes > sizes[-1]:
        return times[-1] + (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]) * (nbytes - sizes[-1])
    return float(np.interp(nbytes, sizes, times))


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """One collective, measured: the medians per size, and the line ``intercept_s +
    seconds_per_byte * nbytes`` through them (what the formulas turn into alpha and B).

    ``gaps`` (optional, per size) is what one more collective adds to a *train* of them issued
    back to back without waiting (as DDP issues its buckets): the stream's occupancy per
    collective, the "gap" of the LogP model. A backend that overlaps consecutive collectives (gloo
    runs them on two worker threads, and a train never returns to Python between them) can have
    gaps below its isolated times; a machine with more busy threads than cores can have gaps
    above them (measured on this project's 2-core VMs, gloo, 4 KiB all-reduces: 2 ranks, a
    short train 0.6x the isolated time per collective, a long one 1.4x; 3 ranks, 2x at any
    length). The gap is what the trains measured, either way.

    ``after_small`` (optional, per size) is the same for a collective that follows a *small* one
    (the smallest size measured) in a train, as a bucket follows a one-bias bucket when every
    gradient is its own bucket: it hides less behind its predecessor than in a train of its own
    size (:func:`hybrid.core.cost.stream_ends`). Never below the gap.
    """

    intercept_s: float
    seconds_per_byte: float
    max_rel_error: float  # of the line on the measured medians
    sizes: tuple = ()  # measured sizes in bytes, ascending
    medians: tuple = ()  # seconds, median over the samples of each size
    gaps: tuple = ()  # seconds per collective in a back-to-back train, per size; () = the medians
    after_small: tuple = ()  # seconds per collective that follows a small one in a train; () = the gaps

    def seconds(self, nbytes: float) -> float:
        """Between measured sizes, the measured medians interpolated; beyond the largest, the last
        two medians' slope; below the smallest, its time (the latency floor).

        A process group on one machine is not one line: a loopback all-reduce runs at cache speed
        below the last-level cache and at memory speed above it (on this project's 2-core VMs the
        slope changes about 3x between 1 and 8 MiB), so a single line misses bucket-sized messages
        by more than the 20% this model is held to.
        """
        if len(self.sizes) < 2:
            return self.intercept_s + self.seconds_per_byte * nbytes
        return _interpolate(self.sizes, self.medians, nbytes)

    def gap_seconds(self, nbytes: float) -> float:
        """What a collective of ``nbytes`` adds to a back-to-back train (:meth:`seconds` where
        no trains were measured)."""
        if len(self.gaps) < 2:
            return self.seconds(nbytes)
        return max(_interpolate(self.sizes, self.gaps, nbytes), 0.0)

    def gap_after_small_seconds(self, nbytes: float) -> float:
        """What a collective of ``nbytes`` adds to a train right after a small one
        (:meth:`gap_seconds` where no such trains were measured)."""
        gap = self.gap_seconds(nbytes)
        if len(self.after_small) < 2:
            return gap
        return max(_interpolate(self.sizes, self.after_small, nbytes), gap)


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Measured costs of the collectives of one process group (or mesh axis).

    Build one with :meth:`fit` from ``(collective, nbytes, seconds)`` samples; ``about`` records
    what it holds for (backend, world size, versions, host), so a cache is used only where it
    is true.

    >>> samples = [(k, n, 1e-4 + n * 1e-9) for k in COLLECTIVES for n in (1 << 10, 1 << 20, 1 << 24)]
    >>> model = CostModel.fit(samples, world_size=2, about={"backend": "gloo"})
    >>> round(model.seconds("all_reduce", 4 << 20) * 1e3, 3)
    4.294
    >>> round(model.link("all_reduce").latency_s * 1e6, 3)  # two ring steps at two ranks share the intercept
    50.0
    """

    world_size: int
    fits: dict  # collective -> Fit
    about: dict = dataclasses.field(default_factory=dict)
    algorithm: str = "ring"

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, int, float]], *, world_size: int, about: dict | None = None,
            algorithm: str = "ring", trains: Iterable[tuple[str, int, int, float]] = (),
            mixed: Iterable[tuple[str, int, int, float]] = ()) -> "CostModel":
        """Least-squares lines through the samples of each collective, weighted by 1/time (so the
        small messages, where latency dominates, count as much as the big ones).

        ``samples`` are ``(collective, nbytes, seconds)`` of isolated collectives; ``trains`` are
        ``(collective, nbytes, count, seconds)``: ``count`` collectives of ``nbytes`` issued back
        to back, from the first issue to the last completion. A train of ``k`` costs the isolated
        time plus ``k - 1`` gaps, so each size's gap is ``(median train - median isolated) / (k - 1)``
        (at least half the train's mean, against noise; it may exceed the isolated time).

        ``mixed`` are ``(collective, nbytes, count, seconds)`` of *mixed* trains: ``count``
        collectives of ``nbytes`` with one of the collective's smallest measured size between each
        two. Each small one adds its gap, each big one after the first what it adds behind a small
        one, so ``after_small = (median - isolated) / (count - 1) - gap(smallest)``, at least the
        size's gap. Sizes without mixed trains (small ones, where the neighbour matters little)
        keep their gap.
        """
        by_kind: dict[str, list[tuple[int, float]]] = {}
        for kind, nbytes, seconds in samples:
            if kind not in COLLECTIVES:
                raise ValueError(f"unknown collective {kind!r} in the samples")
            by_kind.setdefault(kind, []).append((int(nbytes), float(seconds)))
        by_train = _by_kind_and_size(trains, "a train", by_kind)
        by_mixed = _by_kind_and_size(mixed, "a mixed train", by_kind)
        fits = {}
        for kind, rows in sorted(by_kind.items()):
            sizes = sorted({r[0] for r in rows})
            if len(sizes) < 2:
                raise ValueError(f"{kind}: a line needs samples at two sizes or more, got sizes {sizes}")
            # A longer message never takes less time: a median that says otherwise is noise, evened out
            # (planners rely on it: a bucket's collective only grows with its bytes).
            medians = np.maximum.accumulate([float(np.median([t for n, t in rows if n == size])) for size in sizes])
            n, t = np.array(sizes, float), np.array(medians, float)
            w = 1.0 / np.maximum(t, 1e-12)
            coef, *_ = np.linalg.lstsq(np.stack([w, w * n], 1), w * t, rcond=None)
            a, b = max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)
            err = float(np.max(np.abs(a + b * n - t) / t))
            gaps = ()
            if any(k == kind for k, _ in by_train):
                missing = [size for size in sizes if (kind, size) not in by_train]
                if missing:
                    raise ValueError(f"{kind}: trains at some sizes but not at {missing}")
                gaps = tuple(float(g) for g in np.maximum.accumulate(
                    [_gap(by_train[kind, size], alone) for size, alone in zip(sizes, medians)]))
            after_small = _after_small(kind, sizes, medians, gaps, by_mixed)
            fits[kind] = Fit(a, b, err, tuple(sizes), tuple(float(m) for m in medians), gaps, after_small)
        return cls(world_size, fits, dict(about or {}), algorithm)

    def seconds(self, kind: str, nbytes: float) -> float:
        """Predicted time of one collective of ``nbytes`` over the measured group."""
        return self._fit(kind, nbytes, Fit.seconds)

    def gap(self, kind: str, nbytes: float) -> float:
        """What one more collective of ``nbytes`` adds to a back-to-back train of them
        (:meth:`seconds` where no trains were measured)."""
        return self._fit(kind, nbytes, Fit.gap_seconds)

    def _fit(self, kind, nbytes, what) -> float:
        if self.world_size == 1:
            return 0.0
        f = self.fits.get(kind)
        if f is None:
            raise KeyError(f"the cost model measured {sorted(self.fits)}, not {kind!r}")
        return what(f, nbytes)

    def gap_after_small(self, kind: str, nbytes: float) -> float:
        """What a collective of ``nbytes`` adds to a train right after a small one
        (:meth:`gap` where no mixed trains were measured)."""
        return self._fit(kind, nbytes, Fit.gap_after_small_seconds)

    def train_gaps(self, kind: str, nbytes: float) -> tuple[float, float, float]:
        """``(gap, gap after a small one, the small one's time)`` of a collective of ``nbytes``:
        the last three elements of a :func:`hybrid.core.cost.stream_ends` task."""
        sizes = self.fits[kind].sizes if kind in self.fits else ()
        small = self.seconds(kind, sizes[0]) if sizes else 0.0
        return self.gap(kind, nbytes), self.gap_after_small(kind, nbytes), small

    def link(self, kind: str = "all_reduce") -> Link:
        """The measured line as a :class:`Link`, through ``kind``'s formula at the measured size."""
        f = self.fits[kind]
        steps, factor = _steps_and_volume(kind, self.world_size, self.algorithm)
        if steps == 0:
            raise ValueError("a world of one rank measures no link")
        latency = f.intercept_s / steps
        bandwidth = factor / f.seconds_per_byte if f.seconds_per_byte > 0 else math.inf
        return Link(f"measured {self.about.get('backend', '')} {kind} at {self.world_size} ranks".replace("  ", " "),
                    latency, bandwidth)

    def to_json(self) -> dict:
        return {"kind": "CostModel", "world_size": self.world_size, "algorithm": self.algorithm, "about": self.about,
                "fits": {k: dataclasses.asdict(f) for k, f in self.fits.items()}}

    @classmethod
    def from_json(cls, d: dict | str) -> "CostModel":
        if isinstance(d, str):
            d = json.loads(d)
        if d.get("kind") != "CostModel":
            raise ValueError(f"not a CostModel JSON object (kind={d.get('kind')!r})")
        fits = {k: Fit(**{**f, **{key: tuple(f.get(key, ())) for key in ("sizes", "medians", "gaps", "after_small")}})
                for k, f in d["fits"].items()}
        return cls(d["world_size"], fits, d.get("about", {}),
                   d.get("algorithm", "ring"))

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())


def _by_kind_and_size(rows, what: str, by_kind) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """``(collective, nbytes, count, seconds)`` rows grouped by collective and size."""
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for kind, nbytes, count, seconds in rows:
        if kind not in by_kind or int(count) < 2:
            raise ValueError(f"{what} needs isolated samples of its collective and at least 2 collectives of "
                             f"its size, got {kind!r} x {count}")
        out.setdefault((kind, int(nbytes)), []).append((int(count), float(seconds)))
    return out


def _train_median(trains: list[tuple[int, float]], what: str) -> tuple[int, float]:
    """The common length of one size's trains, and their median time."""
    count = trains[0][0]
    if any(k != count for k, _ in trains):
        raise ValueError(f"{what} of one size must have one length, got {sorted({k for k, _ in trains})}")
    return count, float(np.median([t for _, t in trains]))


def _gap(trains: list[tuple[int, float]], alone: float) -> float:
    count, total = _train_median(trains, "the trains")
    return max((total - alone) / (count - 1), total / count / 2)


def _after_small(kind, sizes, medians, gaps, by_mixed) -> tuple:
    """Per size, what a collective adds to a train after a small one (the size's gap where no
    mixed train was measured); () when no mixed train of ``kind`` was."""
    measured = {size: rows for (k, size), rows in by_mixed.items() if k == kind}
    if not measured:
        return ()
    if not gaps:
        raise ValueError(f"{kind}: mixed trains need the same-size trains too (their small ones cost a gap)")
    unknown = sorted(set(measured) - set(sizes))
    if unknown:
        raise ValueError(f"{kind}: mixed trains at sizes {unknown} that were not measured alone")
    out = []
    for size, alone, gap in zip(sizes, medians, gaps):
        rows = measured.get(size)
        if rows is None:
            out.append(gap)
            continue
        count, total = _train_median(rows, "the mixed trains")
        added = (total - alone) / (count - 1) - gaps[0]  # per big one
        out.append(gap if added <= gap * (1 + 1e-9) else added)  # not above the gap by float noise alone
    return tuple(float(a) for a in np.maximum.accumulate(out))  # a longer message never adds less
