"""What each side of a parity run gives back, and the comparison of two runs: numpy only.

Tolerances (the defaults of :class:`Tolerance`). Both sides compute the same float32 network in
different orders: torch's CPU GEMM and XLA's dot block their sums differently, softmax and
layer norms are composed differently, Adam rounds ``m / (sqrt(v) + eps)`` through different
intermediates. Each such difference is an ulp or two (~1e-7 relative) per operation, and Adam's
normalised steps keep them from growing fast. A loss must agree within rtol 1e-5 / atol 1e-6 per
step, a parameter within rtol 1e-4 / atol 1e-5 per element (the figures tests/parity holds the
twin MLP to over 60 steps, where it measures a quarter of them). A real difference is orders of
magnitude above: flax's LayerNorm at its default epsilon (1e-6 for torch's 1e-5) moves the GPT
pair's loss by ~1e-4 at the first step.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SideRun:
    """One side's training: its label, first step, per-step global losses, final parameters (by
    torch's names, in torch's layouts and order), the bucket plan's fingerprint and the loop's
    wall time. (No ``==``: its parameters are arrays; compare runs with :func:`compare`.)"""

    label: str
    start_step: int
    losses: tuple[float, ...]
    params: dict
    plan_fingerprint: str
    seconds: float

    @property
    def stop_step(self) -> int:
        return self.start_step + len(self.losses)


@dataclasses.dataclass(frozen=True, slots=True)
class Tolerance:
    """Per-step loss and per-element parameter tolerances, ``|a - b| <= atol + rtol * |reference|``
    (``numpy.isclose``'s rule); the defaults and why: the module docstring.

    ``per_tensor`` holds some parameters to a pair of their own: ``{pattern: (rtol, atol)}``, a
    pattern being a torch name or an ``fnmatch`` pattern over torch's names; the first that
    matches wins. For a tensor whose exact gradient is zero, say, which each framework moves by its
    own rounding noise (docs/parity.md, "Parameters that rounding alone moves").

    >>> t = Tolerance(per_tensor={"h.*.attn.c_attn.bias": (1e-3, 1e-4)})
    >>> t.param_tolerance("h.0.attn.c_attn.bias"), t.param_tolerance("h.0.attn.c_attn.weight")
    ((0.001, 0.0001), (0.0001, 1e-05))
    """

    loss_rtol: float = 1e-5
    loss_atol: float = 1e-6
    param_rtol: float = 1e-4
    param_atol: float = 1e-5
    per_tensor: tuple = ()  # ((pattern, rtol, atol), ...); a dict {pattern: (rtol, atol)} is accepted

    def __post_init__(self):
        for name in ("loss_rtol", "loss_atol", "param_rtol", "param_atol"):
            _check_tolerance(f"Tolerance.{name}", getattr(self, name))
        items = self.per_tensor.items() if isinstance(self.per_tensor, dict) else (
            (entry[0], tuple(entry[1:])) for entry in self.per_tensor)
        rows = []
        for pattern, pair in items:
            if not isinstance(pattern, str) or not pattern or len(pair) != 2:
                raise ValueError(f"Tolerance.per_tensor wants {{name or pattern: (rtol, atol)}}, got "
                                 f"{pattern!r}: {pair!r}")
            rows.append((pattern, *(_check_tolerance(f"Tolerance.per_tensor[{pattern!r}]", v) for v in pair)))
        object.__setattr__(self, "per_tensor", tuple(rows))

    def param_tolerance(self, name: str) -> tuple[float, float]:
        """``(rtol, atol)`` that parameter ``name`` (torch's name) is held to."""
        for pattern, rtol, atol in self.per_tensor:
            if fnmatch.fnmatchcase(name, pattern):
                return rtol, atol
        return self.param_rtol, self.param_atol

    def check_names(self, names) -> None:
        """A :class:`ToleranceError` if a ``per_tensor`` pattern matches none of ``names`` (torch's
        names): a typo would hold nothing."""
        names = list(names)
        unmatched = [p for p, _, _ in self.per_tensor if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise ToleranceError(f"Tolerance.per_tensor patterns {unmatched} match no tensor of the pair "
                                 f"(torch's names, e.g. {names[:3]})")


class ToleranceError(ValueError):
    """A tolerance that does not fit the pair it is to judge."""


def _check_tolerance(what: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")
    return float(v)


def _ratio(a: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """``|a - ref|`` over what the tolerance allows, elementwise: above 1 breaks it (NaN: inf)."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64))
    allowed = atol + rtol * np.abs(np.asarray(ref, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / allowed)
    return np.where(np.isnan(ratio), np.inf, ratio)


@dataclasses.dataclass(frozen=True, slots=True)
class ParityReport:
    """Two runs compared: the reference (``labels[0]``, torch in :func:`hybrid.parity.run`) and
    the other, over the steps both ran.

    Fields: ``losses`` per side per step from ``start_step``; ``params``: per tensor (torch's
    name and order) ``(name, max |diff|, max of |diff| / allowed, the index where that is)`` of
    the final parameters;
    ``fingerprints`` of the two sides' bucket plans; ``seconds`` of the two training loops.
    """

    labels: tuple[str, str]
    start_step: int
    losses: tuple[tuple[float, ...], tuple[float, ...]]
    params: tuple[tuple[str, float, float, tuple[int, ...]], ...]
    fingerprints: tuple[str, str]
    tolerance: Tolerance = Tolerance()
    seconds: tuple[float, float] = (0.0, 0.0)

    @property
    def steps(self) -> np.ndarray:
        return np.arange(self.start_step, self.start_step + len(self.losses[0]))

    @property
    def loss_diffs(self) -> np.ndarray:
        """``|loss_other - loss_reference|`` per step."""
        return np.abs(np.asarray(self.losses[1]) - np.asarray(self.losses[0]))

    def _loss_ratios(self) -> np.ndarray:
        t = self.tolerance
        return _ratio(self.losses[1], self.losses[0], t.loss_rtol, t.loss_atol)

    @property
    def first_loss_break(self) -> int | None:
        """The first step whose losses differ beyond the tolerance, or None."""
        broken = np.flatnonzero(self._loss_ratios() > 1)
        return int(self.steps[broken[0]]) if broken.size else None

    @property
    def param_breaks(self) -> tuple[str, ...]:
        """The tensors (torch's order) with an element beyond the tolerance."""
        return tuple(name for name, _, ratio, _ in self.params if ratio > 1)

    @property
    def worst_param(self) -> tuple[str, float, float, tuple[int, ...]] | None:
        """The tensor furthest past (or nearest to) its tolerance: ``(name, max |diff|, ratio, index)``."""
        return max(self.params, key=lambda p: p[2]) if self.params else None

    @property
    def max_param_diff(self) -> float:
        return max((d for _, d, _, _ in self.params), default=0.0)

    @property
    def plans_match(self) -> bool:
        return self.fingerprints[0] == self.fingerprints[1]

    @property
    def ok(self) -> bool:
        """Losses and parameters within the tolerance (plans are :func:`assert_parity`'s business)."""
        return self.first_loss_break is None and not self.param_breaks

    @property
    def failures(self) -> tuple[str, ...]:
        """What differs, in words, for the headline: the losses, the parameters, the plans."""
        out = []
        if self.first_loss_break is not None:
            out.append(f"losses from step {self.first_loss_break}")
        if self.param_breaks:
            out.append(f"{len(self.param_breaks)} of {len(self.params)} tensors")
        if not self.plans_match:
            out.append("the bucket plans differ")
        return tuple(out)

    @property
    def headline(self) -> str:
        """``"parity ok"`` only when losses, parameters and plans all agree; else ``"parity FAILED
        (...)"`` naming each of them that does not (also when :func:`assert_parity` is told to
        skip the plans: the report says what it saw)."""
        failures = self.failures
        return f"parity FAILED ({'; '.join(failures)})" if failures else "parity ok"

    def summary(self) -> str:
        """A few lines for people: the verdict, the first break of each kind, the plans."""
        a, b = self.labels
        t, steps, diffs = self.tolerance, self.steps, self.loss_diffs
        lines = [f"{self.headline}: {b} against {a}, steps {steps[0]}..{steps[-1]}"
                 if len(steps) else f"{self.headline}: {b} against {a}, no steps in common"]
        first = self.first_loss_break
        worst_step = int(steps[np.argmax(diffs)]) if len(steps) else None
        if first is None:
            lines.append(f"  losses: within rtol {t.loss_rtol:g} / atol {t.loss_atol:g} at every step; max |diff| "
                         f"{diffs.max() if len(diffs) else 0:.2e} (step {worst_step})")
        else:
            i = first - self.start_step
            ref, other = self.losses[0][i], self.losses[1][i]
            lines.append(f"  losses: first break at step {first}: {a} {ref:.7g}, {b} {other:.7g}, |diff| {diffs[i]:.2e} > "
                         f"{t.loss_atol + t.loss_rtol * abs(ref):.2e} allowed (rtol {t.loss_rtol:g}, atol {t.loss_atol:g}); "
                         f"{int((self._loss_ratios() > 1).sum())} of {len(steps)} steps break, max |diff| "
                         f"{diffs.max():.2e} at step {worst_step}")
        worst = self.worst_param
        if worst is not None:
            breaks = self.param_breaks
            own = f" ({len(t.per_tensor)} pattern(s) with their own)" if t.per_tensor else ""
            head = (f"  params: {len(breaks)} of {len(self.params)} tensors break rtol {t.param_rtol:g} / atol "
                    f"{t.param_atol:g}{own}, first (torch's order) {breaks[0]!r}; " if breaks else
                    f"  params: all {len(self.params)} tensors within rtol {t.param_rtol:g} / atol {t.param_atol:g}{own}; ")
            lines.append(head + f"worst {worst[0]!r}: {worst[2]:.3g}x the allowed at index {list(worst[3])}, "
                                f"max |diff| {worst[1]:.2e}")
        same = "equal" if self.plans_match else "DIFFERENT"
        lines.append(f"  plans: {a} {self.fingerprints[0]}, {b} {self.fingerprints[1]} ({same})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict:
        """A JSON-able dict (:meth:`from_json` reads it back), with the derived verdicts for readers."""
        out = dataclasses.asdict(self)
        out.update(first_loss_break=self.first_loss_break, param_breaks=list(self.param_breaks),
                   plans_match=self.plans_match, ok=self.ok, headline=self.headline,
                   loss_diffs=self.loss_diffs.tolist())
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: dict | str) -> "ParityReport":
        data = json.loads(data) if isinstance(data, str) else data
        return cls(tuple(data["labels"]), int(data["start_step"]), tuple(tuple(x) for x in data["losses"]),
                   tuple((n, float(d), float(r), tuple(i)) for n, d, r, i in data["params"]),
                   tuple(data["fingerprints"]),
                   Tolerance(**data["tolerance"]), tuple(data["seconds"]))

    def plot(self, path) -> None:
        """Save a PNG: both loss curves, and ``|diff|`` per step on a log scale with the tolerance."""
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt

        t, steps = self.tolerance, self.steps
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 2))
        top.plot(steps, self.losses[0], lw=2.5, alpha=0.6, label=self.labels[0])
        top.plot(steps, self.losses[1], "--", label=self.labels[1])
        top.set_ylabel("loss (global batch)")
        top.legend(fontsize=8)
        top.set_title(f"{self.headline}: max |param diff| {self.max_param_diff:.1e}", fontsize=9)
        diffs = self.loss_diffs
        bottom.semilogy(steps, np.where(diffs > 0, diffs, np.nan), "o-", ms=3, label="|loss diff|")
        bottom.semilogy(steps, t.loss_atol + t.loss_rtol * np.abs(np.asarray(self.losses[0])), "k:",
                        label=f"allowed (rtol {t.loss_rtol:g}, atol {t.loss_atol:g})")
        if self.first_loss_break is not None:
            bottom.axvline(self.first_loss_break, color="red", lw=0.8)
        bottom.set_xlabel("step")
        bottom.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def compare(reference: SideRun, other: SideRun, *, tolerance: Tolerance = Tolerance()) -> ParityReport:
    """The two runs over the steps both ran (a resumed run starts later) and their final parameters.

    >>> a = SideRun("a", 0, (1.0, 0.9), {"w": np.ones(2, np.float32)}, "f", 0.0)
    >>> b = SideRun("b", 1, (0.9000001,), {"w": np.ones(2, np.float32) + 1e-3}, "f", 0.0)
    >>> r = compare(a, b)
    >>> r.start_step, r.first_loss_break, r.param_breaks
    (1, None, ('w',))
    """
    start, stop = max(reference.start_step, other.start_step), min(reference.stop_step, other.stop_step)
    if stop <= start:
        raise ValueError(f"{reference.label} ran steps {reference.start_step}..{reference.stop_step - 1} and "
                         f"{other.label} steps {other.start_step}..{other.stop_step - 1}: none in common")
    if list(reference.params) != list(other.params):
        raise ValueError(f"the runs hold different tensors: only in {reference.label} "
                         f"{sorted(set(reference.params) - set(other.params))}, only in {other.label} "
                         f"{sorted(set(other.params) - set(reference.params))}")
    tolerance.check_names(reference.params)
    rows = []
    for name, ref in reference.params.items():
        got = other.params[name]
        if np.shape(got) != np.shape(ref):
            raise ValueError(f"tensor {name!r}: {reference.label} holds shape {np.shape(ref)}, "
                             f"{other.label} {np.shape(got)}")
        diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
        ratio = _ratio(got, ref, *tolerance.param_tolerance(name))
        worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
        rows.append((name, float(diff.max(initial=0.0)), float(ratio.max(initial=0.0)), tuple(int(i) for i in worst)))
    cut = lambda run: tuple(float(x) for x in run.losses[start - run.start_step:stop - run.start_step])
    return ParityReport((reference.label, other.label), start, (cut(reference), cut(other)), tuple(rows),
                        (reference.plan_fingerprint, other.plan_fingerprint), tolerance,
                        (reference.seconds, other.seconds))


def assert_parity(report: ParityReport, *, plans: bool = True) -> None:
    """Raise an AssertionError whose message is :meth:`ParityReport.summary` unless the losses and
    parameters agree within the report's tolerance and (``plans=True``) both sides ran one plan.

    >>> a = SideRun("torch", 0, (1.0, 0.5), {"w": np.zeros(2)}, "f", 0.0)
    >>> b = SideRun("jax", 0, (1.0, 0.6), {"w": np.array([0.0, 1e-3])}, "f", 0.0)
    >>> assert_parity(compare(a, b))
    Traceback (most recent call last):
    ...
    AssertionError: parity FAILED (losses from step 1; 1 of 1 tensors): jax against torch, steps 0..1
      losses: first break at step 1: torch 0.5, jax 0.6, |diff| 1.00e-01 > 6.00e-06 allowed (rtol 1e-05, atol 1e-06); 1 of 2 steps break, max |diff| 1.00e-01 at step 1
      params: 1 of 1 tensors break rtol 0.0001 / atol 1e-05, first (torch's order) 'w'; worst 'w': 100x the allowed at index [1], max |diff| 1.00e-03
      plans: torch f, jax f (equal)
    """
    if not report.ok or (plans and not report.plans_match):
        raise AssertionError(report.summary())
