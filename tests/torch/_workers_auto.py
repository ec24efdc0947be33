"""Ranks of the bucket_cap_mb="auto" tests: torch's DDP (the oracle, torch's default caps) and
hybrid's DDP with auto caps, trained side by side from one init on each rank's own data. Results
travel as numpy arrays (a tensor in a queue is a shared-memory handle that dies with its rank)."""

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from hybrid.core import CopyCost, CostModel, auto_plan
from hybrid.torch import DistributedDataParallel as HybridDDP, ZeRO2
import hybrid.torch.ddp._auto as auto

STEPS = 4
SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
# A group where a message's latency is small beside its bytes and a pass over a gradient is dear:
# the planner reduces the big gradients in place, alone, and shares buckets among the small ones.
MODEL = CostModel.fit([(k, n, 2e-5 + n * 1e-9) for k in ("all_reduce", "broadcast") for n in SIZES], world_size=2)
COPY = CopyCost(5e-9, 1e-5)
LATE_S = 0.5  # how much later rank 1 claims to see gradients in the "disagree" case


def model():
    # 300 x 300 weights: above the reducer's fused-scale size; the rest take the per-bucket path
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 16),
                         nn.ReLU(), nn.Linear(16, 4))


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _patch(mode, rank):
    """Fix the measured inputs (cost model, copy cost, overlap), so the plan is known; with "disagree",
    rank 1 sees every gradient after the first two LATE_S later than it came (the slowest rank's
    times must win, on every rank). LATE_S dwarfs the two ranks' own jitter on a loaded machine, where
    rank 0 alone can be milliseconds behind."""
    if mode == "measured":
        return
    auto.measure_collectives = lambda *a, **k: MODEL
    auto._copy_cost = lambda ddp, nbytes: COPY
    auto._overlap = lambda ddp: 1.0
    if mode == "disagree" and rank == 1:
        times = auto.ReadyClock.times
        auto.ReadyClock.times = lambda self: [t + LATE_S if k >= 2 else t for k, t in enumerate(times(self))]


def train(world, mode, rank, port, out):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        _patch(mode, rank)
        zero = mode == "zero2"
        ref = torch.nn.parallel.DistributedDataParallel(model()) if not zero else HybridDDP(model())
        ours = HybridDDP(model(), bucket_cap_mb="auto")
        if zero:
            opts = [ZeRO2(ref, torch.optim.Adam, lr=0.01), ZeRO2(ours, torch.optim.Adam, lr=0.01)]
        else:
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
        grads, params = [], []
        for step in range(STEPS):
            x, y = _data(rank, step)
            for m, opt in zip((ref, ours), opts):
                opt.zero_grad(set_to_none=True)
                ((m(x) - y) ** 2).mean().backward()
            if not zero:
                grads.append([[p.grad.numpy().copy() for p in m.parameters()] for m in (ref, ours)])
            for opt in opts:
                opt.step()
            params.append([[p.detach().numpy().copy() for p in m.parameters()] for m in (ref, ours)])
        plan = ours.bucket_plan
        report = getattr(ours, "_auto_report", None)
        result = {"grads": grads, "params": params, "plan": plan.dumps(), "fingerprint": plan.fingerprint(),
                  "in_place": sum(b.in_place for b in plan.buckets), "buckets": plan.bucket_indices(),
                  "report": None if report is None else {k: report[k] for k in ("ready_order", "ready_s")},
                  "mine": ours._reducer.rebuild.last_ready_s}
        if mode == "disagree":  # what the plan must be: rank 0's order, the slowest rank's times
            result["expected"] = auto_plan(plan.specs, report["ready_order"], report["ready_s"], MODEL,
                                           copy=COPY).fingerprint()
        out.put((rank, result, 0.0))
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the test
        import traceback
        out.put((rank, f"{e!r}\n{traceback.format_exc()}", 0.0))


def measured(world, cache_dir, rank, port, out):
    """The whole path with nothing patched: the real probe (cached under ``cache_dir``)."""
    os.environ["HYBRID_CACHE_DIR"] = cache_dir
    train(world, "measured", rank, port, out)

