"""Faults in a ZeRO3 step: a rank that dies (or stalls past the process group's timeout) in a
gather or a gradient reduction makes the survivor raise within ~2x the timeout, naming the
collective. One small 2-rank spawn per case, 5 s process-group timeout."""

import datetime
import os
import time

import pytest
import torch

from tests._procs import forkserver_ranks, report_outcome

TIMEOUT_S = 5

# mode -> (ZeRO3 options, where the victim (rank 1) fails, what the survivor's message must hold)
MODES = {
    # the victim never starts its forward: the survivor waits in the check every call begins with
    "forward-check": ({}, "exit-before-forward", "ZeRO3 forward: the check that every rank entered this call"),
    # the victim dies as its first module starts: the survivor waits in the first gather
    "forward-gather": ({}, "exit-in-first-module", "ZeRO3 forward: the broadcast of rank "),
    "forward-all-gather": ({"flat": True}, "exit-in-first-module",
                           "ZeRO3 forward: the all-gather of bucket 0's parameters failed"),
    "forward-gather-stall": ({}, "stall-in-first-module", "ZeRO3 forward: the broadcast of rank "),
    # the victim dies as its backward begins; with the buckets kept from the forward the
    # survivor's first collective of the backward is the reduction of gradient bucket 0
    "backward-all-reduce": ({"reshard_after_forward": False}, "exit-in-backward",
                            "ZeRO3 backward: the all-reduce of gradient bucket 0 failed"),
    "backward-reduce-scatter": ({"reshard_after_forward": False, "flat": True}, "exit-in-backward",
                                "ZeRO3 backward: the reduce-scatter of gradient bucket 0 failed"),
    # ... and with them freed, its first backward gather (or, if the victim's part of that was
    # sent before it died, the reduction after it)
    "backward-gather": ({}, "exit-in-backward", "ZeRO3 backward: the "),
}


def _worker(mode, rank, port, out):
    import torch.distributed as dist

    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    options, fault, _ = MODES[mode]
    options = dict(options)
    flat = options.pop("flat", False)
    model = ZeRO3(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), bucket_cap_mb=1e-4, **options)
    if flat:
        model._buckets.flat_collectives = model._grads.flat_collectives = True
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    armed = [False]

    def die_in_backward(grad):
        if armed[0]:
            os._exit(17)  # no exception, no cleanup: a crashed rank
        return grad

    def in_first_module(module, args):
        if armed[0] and fault == "exit-in-first-module":
            os._exit(17)
        if armed[0] and fault == "stall-in-first-module":
            time.sleep(3 * TIMEOUT_S)

    # Before ZeRO3's own hook: after the forward's check, before its first gather.
    model.module[0].register_forward_pre_hook(in_first_module, prepend=True)

    def iteration():
        if armed[0] and fault == "exit-before-forward":
            os._exit(17)
        out = model(torch.ones(3, 4))
        if rank == 1:
            out.register_hook(die_in_backward)
        out.sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # good steps: the setup works
        iteration()
    armed[0] = rank == 1
    report_outcome(rank, out, iteration)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
def test_peer_fault_raises_naming_the_collective(mode):
    _, fault, expected = MODES[mode]
    reports, procs = forkserver_ranks(_worker, (mode,), 1)
    assert list(reports) == [0], reports
    outcome, seconds = reports[0]
    print(f"{mode}: rank 0 raised after {seconds:.2f} s: {outcome[:300]}")
    if fault.startswith("exit"):
        assert procs[1].exitcode == 17
    assert expected in outcome, outcome
    assert "a peer died or stalled past the process group's timeout" in outcome, outcome
    assert seconds < 2 * TIMEOUT_S, f"the survivor took {seconds:.1f} s to raise: {outcome}"
