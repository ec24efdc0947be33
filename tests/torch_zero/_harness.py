"""Run tables of multi-process cases: spawn one gloo world per world size, run every case in it.

Process start-up (and importing torch) dominates small cases, so each world is spawned once
and all its cases run inside the same workers, one after another, each from a fresh seed.
A case passes when it raises on no rank.
"""

from __future__ import annotations

import datetime
import importlib
import queue
import traceback

from tests._procs import forkserver_context, free_port

# A hung collective must turn into an error well inside pytest's 180 s per-test timeout.
COLLECTIVE_TIMEOUT_S = 45


def _worker(rank: int, world_size: int, port: int, module: str, case_ids: list[str], out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores, up to 3 ranks: oversubscription only slows everything
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    cases = importlib.import_module(module).CASES
    for case_id in case_ids:
        torch.manual_seed(0)
        try:
            cases[case_id](rank, world_size)
            err = None
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            err = f"rank {rank}:\n{traceback.format_exc()}"
        out.put((rank, case_id, err))
        if err is not None:
            break  # collectives may now be out of step; the remaining cases are reported missing
        dist.barrier()
    dist.destroy_process_group()


def run_world(module: str, case_ids: list[str], world_size: int, *, timeout_s: float) -> dict[str, list[str]]:
    """``{case_id: [errors from any rank]}``; a case a rank never reported counts as an error."""
    ctx = forkserver_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, module, case_ids, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reported: dict[str, list] = {c: [] for c in case_ids}
    errors: dict[str, list[str]] = {c: [] for c in case_ids}
    import time
    deadline = time.monotonic() + timeout_s
    pending = len(case_ids) * world_size
    while pending and time.monotonic() < deadline:
        try:
            rank, case_id, err = out.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        pending -= 1
        reported[case_id].append(rank)
        if err is not None:
            errors[case_id].append(err)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for c in case_ids:
        missing = sorted(set(range(world_size)) - set(reported[c]))
        if missing and not errors[c]:
            errors[c].append(f"ranks {missing} never reported (an earlier case failed, a crash or a timeout)")
    return errors


def world_case_tests(cases_module, world_sizes=(1, 2, 3), *, timeout_s: float = 170):
    """A module fixture and a test that run every case of ``cases_module.CASES`` in every world.

    One spawn per world size runs all cases; each (case, world) is then its own test. Use as
    ``world_results, test_case = world_case_tests(_cases)`` at a test module's top level.
    """
    import pytest

    case_ids = sorted(cases_module.CASES)

    @pytest.fixture(scope="module")
    def world_results():
        results = {}

        def get(world_size):
            if world_size not in results:
                results[world_size] = run_world(cases_module.__name__, case_ids, world_size, timeout_s=timeout_s)
            return results[world_size]
        return get

    @pytest.mark.parametrize("world_size", world_sizes)
    @pytest.mark.parametrize("case_id", case_ids)
    def test_case(world_results, world_size, case_id):
        errors = world_results(world_size)[case_id]
        assert not errors, "\n".join(errors)

    return world_results, test_case
