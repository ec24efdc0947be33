"""Habits of a torch user scaling a DDP script out to ZeRO3, run as they run it: the script a user
launches with torchrun, 2 and 4 processes (``_habits_script.py`` says what each check does). Each
rank writes its results; a crash (the SIGSEGV of issue 36) fails the run.

Each rank is a forkserver process (``tests/_procs``) given the environment torchrun gives a worker
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, one thread) that runs
the script as ``__main__``: the same code, the same ``env://`` rendezvous. What torchrun adds, a
launcher interpreter and a fresh interpreter per rank importing torch (~3 s of CPU each: the
file took 35 s of CPU under torchrun, 7 s so), is nothing these tests check; a rank that crashes
shows as its exit code (-11 for a SIGSEGV), which fails the test. A crash at interpreter exit is
tests/torch/test_teardown.py's subject. Each run is a world of its own: the scripts are a user's whole program, group set-up and
teardown included (and the mixed one leaves its group unusable on purpose).
"""

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from tests._procs import forkserver_context, free_port

ROOT = Path(__file__).resolve().parents[2]


def _as_torchrun_worker(script: str, argv: list[str], env: dict, rank: int, world: int, port: int) -> None:
    """One rank: torchrun's environment for it, then ``script`` run as ``__main__``."""
    import torch
    import torch.distributed as dist

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.set_debug_level_from_env()  # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported: read it again
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def run_like_torchrun(script: Path, world: int, argv: list[str], *, env: dict | None = None,
                      timeout_s: float = 150) -> None:
    """``torchrun --nproc_per_node=WORLD SCRIPT ARGV...``, its ranks forked from the forkserver; fails
    the test with each rank's exit code if any rank exits non-zero or outlives ``timeout_s``."""
    ctx = forkserver_context()
    port = free_port()
    procs = [ctx.Process(target=_as_torchrun_worker, args=(str(script), argv, env or {}, r, world, port))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"{script.name} with {world} processes: exit codes {codes} (-9: killed at the timeout)"


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp("habits")
    run_like_torchrun(ROOT / "tests" / "torch_zero3" / "_habits_script.py", world, [str(out)])
    rows = [json.loads(line) for r in range(world) for line in (out / f"rank-{r}.jsonl").read_text().splitlines()]
    by_check = {}
    for row in rows:
        by_check.setdefault(row.pop("check"), {})[row.pop("rank")] = row
    assert all(len(v) == world for v in by_check.values()), by_check
    return world, by_check


@pytest.mark.timeout(170)
def test_inner_module_gives_ddps_outputs(results):
    """Exact at 2 processes (the same ops on the same values); at 4 gloo sums four terms in another
    order than DDP's buckets: rtol-free 5e-6 (seen: ~1e-7)."""
    world, by_check = results
    for model in ("root_scale", "tiny_gpt"):
        for rank, row in by_check[f"inner_module[{model}]"].items():
            for how in ("no_grad", "gathered"):
                assert row[how] <= (0 if world == 2 else 5e-6), (model, rank, how, row)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("num_buckets", [7, 1])
def test_rank0_only_save_fails_at_once_on_every_rank(results, num_buckets):
    world, by_check = results
    for rank, row in by_check[f"rank0_only_save[{num_buckets}]"].items():
        outcome = row["outcome"]
        assert "ranks entered different collective calls" in outcome, (rank, outcome)
        assert "rank 0 is in ZeRO3 state_dict()" in outcome and "rank 1 is in ZeRO3 forward" in outcome, outcome
        assert "model.full_state_dict()" in outcome and "hybrid.checkpoint.torch.save" in outcome, outcome
        assert row["seconds"] < 5, row
    full = by_check[f"full_state_dict[{num_buckets}]"]
    assert full[0] == {"keys": 14, "same": True}
    assert all(full[r] == {"keys": 0, "same": True} for r in range(1, world))
    files = by_check[f"per_rank_save[{num_buckets}]"][0]["files"]
    assert files == ["manifest.json"] + [f"rank-{r:05d}-of-{world:05d}.safetensors" for r in range(world)]


@pytest.mark.timeout(170)
def test_a_rank_in_its_own_collective_is_named_under_torchs_check(tmp_path):
    """Rank 0 in a ``dist.barrier()`` of its own while rank 1 runs a ZeRO3 forward: hybrid's check
    cannot see a collective it does not issue (the ranks would wait out the group's timeout), but
    with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch compares every collective first, and both ranks
    raise at once; rank 1's error names its ZeRO3 call, torch's finding and the fix."""
    run_like_torchrun(ROOT / "tests" / "torch_zero3" / "_mixed_script.py", 2, [str(tmp_path)],
                      env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    rows = [json.loads((tmp_path / f"mixed-{r}.json").read_text()) for r in range(2)]
    for rank, row in enumerate(rows):
        assert row["seconds"] < 5, (rank, row)
        assert "Detected mismatch between collectives" in row["outcome"], (rank, row)
    outcome = rows[1]["outcome"]
    assert outcome.startswith("ZeRO3 forward: the check that every rank entered this call"), outcome
    # (torch's account of what rank 0 is in varies from run to run: BARRIER, or a REDUCE of its own)
    assert "found the ranks in different collectives" in outcome and "dist.barrier()" in outcome, outcome
