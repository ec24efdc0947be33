"""Several torch sides of the parity harness in one gloo world, its ranks forked from the preloaded
forkserver of tests/_procs.py: a fresh interpreter importing torch and hybrid.torch per rank (what
``hp.train_torch``'s ``spawn_world`` starts, by design: a user's script is never run again) was most
of a small run's CPU time, so a test file hands its runs to one world of forked ranks.

Each job is ``hybrid.parity._run_torch.train_rank(job)``, the function ``hp.train_torch``'s ranks
run, after the numerics ``spawn_world``'s ranks pin (``pin_torch_numerics``); the jobs come from
``hybrid.parity._harness.torch_job``, checked as ``hp.train_torch`` checks its arguments. What
``hp.run`` and ``hp.handover`` add around their worlds is tested through them (test_harness.py).
"""

from __future__ import annotations

from tests._procs import torch_world


def _train_jobs(jobs: list, progress=None) -> list:
    """Every job in order on this rank: the SideRuns (rank 0's are returned)."""
    from hybrid.parity._run_torch import train_rank

    return [train_rank(job) for job in jobs]


def torch_runs(jobs: dict, *, world_size: int = 2, timeout_s: float = 150) -> dict:
    """``{name: SideRun}`` of ``{name: job}``, trained in one world of ``world_size`` forked ranks
    (:func:`tests._procs.torch_world`); a rank that fails fails the test with its traceback, one
    that hangs past ``timeout_s`` too, the ranks killed."""
    return dict(zip(jobs, torch_world(_train_jobs, list(jobs.values()), world_size=world_size, wait_s=timeout_s)))
