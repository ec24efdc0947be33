"""When a run of the twin models saves, and where it resumes from: the same for both frontends.

A run saves once (``save_to`` after step ``save_at``), every ``save_every`` steps into
``checkpoint_dir/step-NNNNNN``, or both; with a ``checkpoint_dir`` and no explicit ``resume`` it
resumes from the newest complete checkpoint there (:func:`hybrid.checkpoint.latest`), so a job that
crashed continues when the same command is launched again.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpointing:
    """A run's saves and resume.

    >>> plan = Checkpointing(checkpoint_dir="ckpts", save_every=4)
    >>> [(lo, hi, where) for lo, hi, where in plan.segments(2, 10)]
    [(2, 4, 'ckpts/step-000004'), (4, 8, 'ckpts/step-000008'), (8, 10, None)]
    >>> Checkpointing(save_to="once", save_at=3).segments(0, 5)
    [(0, 3, 'once'), (3, 5, None)]
    """

    resume: str | None = None
    save_to: str | None = None
    save_at: int | None = None
    checkpoint_dir: str | None = None
    save_every: int | None = None

    def __post_init__(self):
        if self.save_every is not None:
            if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 1:
                raise ValueError(f"save_every must be a positive int of steps, got {self.save_every!r}")
            if self.checkpoint_dir is None:
                raise ValueError("save_every needs checkpoint_dir: the folder its step-NNNNNN checkpoints go to")

    def resume_path(self) -> str | None:
        """``resume`` if given, else the newest checkpoint in ``checkpoint_dir`` (None: start afresh)."""
        if self.resume is not None or self.checkpoint_dir is None or not os.path.isdir(self.checkpoint_dir):
            return self.resume
        from hybrid.checkpoint import latest
        found = latest(self.checkpoint_dir)
        return None if found is None else str(found)

    def segments(self, start: int, stop: int) -> list[tuple[int, int, str | None]]:
        """``(lo, hi, path)``: train steps ``lo..hi-1``, then save to ``path`` (None: no save)."""
        saves = []
        if self.save_to is not None:
            saves.append((stop if self.save_at is None else self.save_at, self.save_to))
        if self.save_every is not None:
            first = (start // self.save_every + 1) * self.save_every
            saves += [(k, os.path.join(self.checkpoint_dir, f"step-{k:06d}")) for k in range(first, stop + 1,
                                                                                           self.save_every)]
        saves = sorted(s for s in saves if start <= s[0] <= stop)
        out, lo = [], start
        for step, where in saves:
            out.append((lo, step, where))
            lo = step
        if lo < stop or not out:
            out.append((lo, stop, None))
        return out
