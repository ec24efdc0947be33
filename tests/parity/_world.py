"""Several torch sides of the parity harness in one gloo world: a world's start (2 fresh
interpreters importing torch) is most of a small run's CPU time, so a test file hands its runs to
one world (``hybrid.parity._harness.torch_job`` builds each, checked as ``hp.train_torch`` checks them).
Each job is ``hybrid.parity._run_torch.train_rank``, the function ``hp.train_torch``'s ranks run."""

from __future__ import annotations


def train_jobs(jobs: list, *, progress=None) -> list:
    """Every job, in order, on every rank of the world; rank 0's :class:`~hybrid.parity.SideRun` of each."""
    from hybrid.parity._run_torch import train_rank

    del progress
    return [train_rank(job) for job in jobs]


def torch_runs(jobs: dict, *, world_size: int = 2, timeout_s: float = 400) -> dict:
    """``{name: SideRun}`` of ``{name: job}``, trained in one spawned world of ``world_size`` ranks
    (a rank that fails fails them all, with its traceback, as ``hp.train_torch`` does)."""
    from hybrid.demo import spawn_world

    return dict(zip(jobs, spawn_world(train_jobs, list(jobs.values()), world_size=world_size, timeout_s=timeout_s)))
