"""2-rank gloo cases: torch.compile(hybrid DDP) against eager hybrid DDP and torch's compiled DDP.

Every case trains the same model from the same seed on rank-dependent data with SGD for a few steps
and compares parameters at rtol 1.3e-6 / atol 1e-6 (float32, same framework). Run by
``test_compile_dist`` in one spawn of two ranks (``tests/torch_zero/_harness``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import hybrid.torch as ht

RTOL, ATOL = 1.3e-6, 1e-6
TINY_MB = 2000 / 2**20  # ~2 KB buckets and pieces: several per model


class MLP(nn.Module):
    def __init__(self, width=24, depth=4, graph_break=False):
        super().__init__()
        dims = [8] + [width] * (depth - 1) + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.graph_break = graph_break

    def forward(self, x):
        x = self._run(x, 0, 2)
        if self.graph_break:
            torch._dynamo.graph_break()  # outside the loop: dynamo resumes after it in this frame
        return self._run(x, 2, len(self.layers))

    def _run(self, x, start, stop):
        for i in range(start, stop):
            x = self.layers[i](x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.never, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _data(rank, steps=3):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(6, 8, generator=g) for _ in range(steps)]


def _train(model, data, *, no_sync_first=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data):
        if no_sync_first and i == 0:
            with model.no_sync():
                model(x).pow(2).sum().backward()
            continue
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _close(what, got, want):
    for (n, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {n}: {m}")


def _reset():
    torch._dynamo.reset()


def _vs_oracles(backend):
    def case(rank, world_size):
        _reset()
        base = MLP()
        data = _data(rank)
        eager = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
        _train(eager, data)
        ddp = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
        _train(torch.compile(ddp, backend=backend), data)
        # torch's DDPOptimizer asserts on caps below its 1 MiB first bucket: default caps there.
        theirs = TorchDDP(copy.deepcopy(base))
        _train(torch.compile(theirs, backend=backend), data)
        _close("compiled hybrid DDP vs eager hybrid DDP", ddp.module, eager.module)
        _close("compiled hybrid DDP vs torch's compiled DDP", ddp.module, theirs.module)
        reports = ht.split_reports(ddp)
        assert len(reports) == 1 and reports[0].reason is None and reports[0].num_pieces > 1, reports
        plan = reports[0].plan
        # The reducer rebuilt its buckets from the graph's order: same parameter order as the pieces.
        order = [plan.specs[i].name for k in range(plan.num_pieces) for i in plan.members(k)]
        names = [ddp.bucket_plan.specs[m].name for b in ddp.bucket_plan.buckets for m in b.members]
        assert order == names, (order, names)
        fps = [None] * world_size
        dist.all_gather_object(fps, plan.fingerprint())
        assert len(set(fps)) == 1, fps
    return case


def no_sync(rank, world_size):
    _reset()
    base, data = MLP(), _data(rank, steps=4)
    eager = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    _train(eager, data, no_sync_first=True)
    ddp = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    compiled = torch.compile(ddp, backend="aot_eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i, x in enumerate(data):
        if i == 0:
            with ddp.no_sync():
                compiled(x).pow(2).sum().backward()
            continue
        compiled(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    _close("no_sync: compiled vs eager hybrid DDP", ddp.module, eager.module)


def find_unused(rank, world_size):
    _reset()
    base, data, cap = Unused(), _data(rank), 200 / 2**20   # b (272 bytes) and a: two pieces
    eager = ht.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=cap)
    _train(eager, data)
    ddp = ht.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=cap)
    _train(torch.compile(ddp, backend="aot_eager"), data)
    _close("find_unused_parameters: compiled vs eager", ddp.module, eager.module)
    assert ddp.module.never.weight.grad is None
    assert ht.split_reports(ddp)[0].num_pieces == 2


def graph_break(rank, world_size):
    _reset()
    base, data = MLP(graph_break=True), _data(rank)
    eager = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    _train(eager, data)
    ddp = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    _train(torch.compile(ddp, backend="aot_eager"), data)
    _close("graph break: compiled vs eager", ddp.module, eager.module)
    assert len(ht.split_reports(ddp)) == 2


def optimize_ddp_off(rank, world_size):
    _reset()
    base, data = MLP(), _data(rank)
    eager = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    _train(eager, data)
    ddp = ht.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    with torch._dynamo.config.patch(optimize_ddp=False):
        _train(torch.compile(ddp, backend="aot_eager"), data)
    _close("optimize_ddp=False: compiled vs eager", ddp.module, eager.module)
    assert ht.split_reports(ddp) == []


def explicit_caps(rank, world_size):
    _reset()
    base, data = MLP(), _data(rank)
    eager = ht.DistributedDataParallel(copy.deepcopy(base))
    _train(eager, data)
    ddp = ht.DistributedDataParallel(copy.deepcopy(base))    # one 25 MiB bucket, pieces of ~0 MiB
    with torch._dynamo.config.patch(optimize_ddp=False):      # hybrid.torch.compile splits anyway
        _train(ht.compile(ddp, backend="eager", split_cap_mb=0), data)
    _close("split_cap_mb=0: compiled vs eager", ddp.module, eager.module)
    assert ht.split_reports(ddp)[0].num_pieces == 4   # one piece per linear: cap below every parameter


# One backend here: aot_eager runs dynamo's capture and aot_autograd's per-piece forward/backward,
# which is what the split changes; test_compile.py checks eager, aot_eager and inductor pieces
# against the uncompiled model in one process (inductor over two ranks costs ~40 s cold).
CASES = {"vs_oracles_aot_eager": _vs_oracles("aot_eager"),
         "no_sync": no_sync, "find_unused": find_unused, "graph_break": graph_break,
         "optimize_ddp_off": optimize_ddp_off, "explicit_caps": explicit_caps}
