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

import traceback

from tests._procs import forkserver_ranks, init_gloo


def _train_jobs(jobs: list, world: int, rank: int, port: int, out) -> None:
    """One rank: every job in order; rank 0 reports the SideRuns, a rank that fails its traceback."""
    try:
        import torch.distributed as dist

        from hybrid.demo._torch_run import pin_torch_numerics
        from hybrid.parity._run_torch import train_rank

        init_gloo(rank, port, world=world, timeout_s=60)
        pin_torch_numerics()
        runs = [train_rank(job) for job in jobs]
        dist.destroy_process_group()
        out.put((rank, runs if rank == 0 else "returned", 0.0))
    except BaseException:  # noqa: BLE001 - reported to the test, which raises it
        out.put((rank, f"rank {rank} of {world} failed:\n{traceback.format_exc()}", 0.0))


def torch_runs(jobs: dict, *, world_size: int = 2, timeout_s: float = 150) -> dict:
    """``{name: SideRun}`` of ``{name: job}``, trained in one world of ``world_size`` forked ranks;
    a rank that fails is raised here with its traceback (the test fails if a rank hangs past
    ``timeout_s``, the ranks killed)."""
    reports, _ = forkserver_ranks(_train_jobs, (list(jobs.values()), world_size), world_size, world=world_size,
                                  wait_s=timeout_s)
    failed = [outcome for outcome, _ in reports.values() if isinstance(outcome, str) and outcome != "returned"]
    if failed:
        raise RuntimeError("\n".join(failed))
    return dict(zip(jobs, reports[0][0]))
