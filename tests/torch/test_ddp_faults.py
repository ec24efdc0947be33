"""A DDP peer that dies or stalls: the survivor raises within the process group's timeout (2 s
here, set once the setup is done; the test allows 2x), with a message naming the collective that
gave up, never hangs.

One 2-rank forkserver launch per case (a rank dies or stalls, so no world can be shared). The group
starts with a 30 s timeout, so that a slow start on a loaded machine is not taken for a fault. The
victim does two good iterations (so DDP has rebuilt its buckets), both ranks then set the 2 s
timeout, and the victim dies (``os._exit``) or stalls (until the survivor has reported, at most 3x
the timeout) at the point the case names; the survivor runs one more iteration and reports what it
raised and after how long. The existing
``test_dead_peer_raises_quickly`` in test_ddp.py checks a 60 s group (gloo notices the closed
socket); these use the short timeout a user would set to fail fast, and check the wording.
"""

import datetime
import os
import time

import pytest
import torch

from tests._procs import forkserver_context, forkserver_ranks

SETUP_TIMEOUT_S = 30
TIMEOUT_S = 2  # the process group's timeout once the setup is done: what the survivor must meet

# case -> (what the victim does before its third iteration, what the survivor's message contains)
CASES = {
    "backward-dies": ("die", "DistributedDataParallel backward: the all-reduce of gradient bucket 0 failed"),
    "backward-stalls": ("stall", "DistributedDataParallel backward: the all-reduce of gradient bucket 0 failed"),
    "buffers-die": ("die", "DistributedDataParallel forward: the broadcast of rank 0's buffers failed"),
    "comm-hook-dies": ("die", "DistributedDataParallel backward: the communication hook's Future of gradient "
                              "bucket 0 failed"),
    "unused-dies": ("die", "DistributedDataParallel backward: the all-reduce of gradient bucket 0 failed"),
    "join-dies": ("die", "DistributedDataParallel forward (Join): the all-reduce that counts the ranks still "
                         "training failed"),
}


class _WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.bn(self.lin(x)))


class _Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.never, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _fault_worker(case, survivor_done, rank, port, out):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from hybrid.torch import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
    torch.manual_seed(0)
    model = {"buffers-die": _WithBuffers, "unused-dies": _Unused}.get(
        case, lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))()
    ddp = DistributedDataParallel(model, find_unused_parameters=case == "unused-dies")
    if case == "comm-hook-dies":
        ddp.register_comm_hook(dist.group.WORLD, allreduce_hook)
    x = torch.randn(3, 4) + rank

    def iteration():
        ddp(x).sum().backward()

    for _ in range(2):
        iteration()
    dist.barrier()
    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    fault, _ = CASES[case]
    if rank == 1:
        # "buffers-die" dies before its forward (the survivor's buffer broadcast fails); the
        # others die or stall between forward and backward (the bucket all-reduce fails).
        if case == "buffers-die":
            os._exit(17)
        ddp(x)
        if fault == "die":
            os._exit(17)
        # stalls until the survivor has reported (at most 3x the timeout): past the survivor's
        # timeout, and no longer than it takes the test to read the report
        survivor_done.wait(3 * TIMEOUT_S)
        os._exit(0)
    grads = [p.grad.clone() for p in ddp.parameters() if p.grad is not None]
    params = [p.detach().clone() for p in ddp.parameters()]
    t0 = time.monotonic()
    try:
        if case == "join-dies":
            with ddp.join():
                iteration()
                iteration()
        else:
            iteration()
        out.put((rank, "returned", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - what the survivor raises is the test's subject
        seconds = time.monotonic() - t0
        unchanged = all(torch.equal(a, p.detach()) for a, p in zip(params, ddp.parameters()))
        out.put((rank, (f"{type(e).__name__}: {e}", unchanged, len(grads)), seconds))
    survivor_done.set()


def _hook_bug_worker(rank, port, out):
    """Both ranks healthy; the comm hook's Future callback raises: that error, not a dead peer."""
    import torch.distributed as dist

    from hybrid.torch import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))

    def buggy(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())

        def callback(f):
            raise RuntimeError("a bug in the hook's own code")
        return fut.then(callback)
    ddp.register_comm_hook(None, buggy)
    t0 = time.monotonic()
    try:
        ddp(torch.ones(3, 4)).sum().backward()
        out.put((rank, "returned", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


@pytest.mark.timeout(120)
def test_comm_hook_bug_is_not_reported_as_a_dead_peer():
    reports, _ = forkserver_ranks(_hook_bug_worker, (), 2)
    for rank, (outcome, _) in reports.items():
        assert "a bug in the hook's own code" in outcome, (rank, outcome)
        assert "peer died" not in outcome, (rank, outcome)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_ddp_peer_fault_raises_naming_the_collective(case):
    fault, expected = CASES[case]
    reports, procs = forkserver_ranks(_fault_worker, (case, forkserver_context().Event()), 1)
    assert list(reports) == [0], reports
    outcome, seconds = reports[0]
    assert outcome != "returned", f"{case}: the survivor's iteration returned after {seconds:.1f} s"
    message, params_unchanged, _ = outcome
    print(f"{case}: rank 0 raised after {seconds:.2f} s: {message[:300]}")
    assert expected in message, message
    assert "a peer died or stalled past the process group's timeout" in message, message
    assert seconds < 2 * TIMEOUT_S, f"the survivor took {seconds:.1f} s to raise: {message}"
    assert params_unchanged  # DDP itself never writes parameters; the optimizer step never ran
    if fault == "die":
        procs[1].join(timeout=5)
        assert procs[1].exitcode == 17
