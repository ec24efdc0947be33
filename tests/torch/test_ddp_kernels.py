"""Which copy path hybrid's DDP takes between gradients and buckets: ``hybrid.kernels`` for CUDA
tensors (when the library is built, unless forced off), torch's own copies otherwise.

This machine has no GPU, so the decision is tested by monkeypatching: the loader pretends to find
the library, the DDP is told its tensors are on CUDA, and ``kernels.gather`` / ``kernels.scatter``
are wrapped to record their calls and run the reference path. Training must then match torch's
DDP as it does on the CPU path, with one gather per bucket per iteration. The kernels themselves
are tested in ``tests/kernels`` (bit for bit on a GPU; skipped without one).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hybrid import kernels
from hybrid.kernels import _build as kernels_build
from hybrid.torch import DistributedDataParallel as HybridDDP
from hybrid.torch.ddp.reducer import _buckets

# float32, same framework, same bucket layout, world size 1 (no reduction arithmetic): torch's
# oracle and ours agree bit for bit; the bound is the project's float32 budget.
RTOL, ATOL = 1.3e-6, 1e-6


@contextlib.contextmanager
def single_rank_group(backend: str, **kwargs):
    """A one-rank process group of ``backend`` on a free local port, destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30), **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def process_group():
    with single_rank_group("gloo"):
        yield


@pytest.mark.parametrize("device, env, built, expect", [
    ("cpu", None, True, "reference"),
    ("cpu", "cuda", True, "reference"),     # CPU tensors keep torch's copies, whatever is forced
    ("cuda", None, True, "cuda"),
    ("cuda", "auto", True, "cuda"),
    ("cuda", None, False, "reference"),     # not built: torch's copies
    ("cuda", "reference", True, "reference"),
    ("cuda", "cuda", True, "cuda"),
    ("cuda", "cuda", False, RuntimeError),  # forced but cannot run: loud
    ("cuda", "triton", True, ValueError),
])
def test_copy_backend_decision(monkeypatch, device, env, built, expect):
    monkeypatch.setattr(kernels_build, "_library", (lambda: object()) if built else (lambda: None))
    if env is None:
        monkeypatch.delenv("HYBRID_KERNELS", raising=False)
    else:
        monkeypatch.setenv("HYBRID_KERNELS", env)
    if isinstance(expect, str):
        assert _buckets._bucket_copy_backend(torch.device(device)) == expect
    else:
        with pytest.raises(expect):
            _buckets._bucket_copy_backend(torch.device(device))


class _Net(nn.Module):
    """Several buckets at bucket_cap_mb=0.004, and a layer only some steps use."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in [(8, 32), (32, 32), (32, 32), (32, 4)])
        self.extra = nn.Linear(4, 4)

    def forward(self, x, use_extra=True):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return self.extra(x) if use_extra else x


def _train(ddp, steps=3, unused_steps=()):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(6, 8, generator=g).to(next(ddp.module.parameters()).device)
        ddp(x, use_extra=step not in unused_steps).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def torch_ddp_takes(kwargs) -> bool:
    """Whether this torch's DistributedDataParallel knows every keyword of ``kwargs`` (a GPU
    machine's torch can be older than the pinned one: 2.11 has no ``batched_grad_copy``)."""
    return set(kwargs) <= set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)


CASES = {  # name -> (DDP kwargs, comm hook?, steps that leave ``extra`` unused)
    "default": ({}, False, ()),
    "many_buckets": ({"bucket_cap_mb": 0.004}, False, ()),
    "batched_grad_copy": ({"bucket_cap_mb": 0.004, "batched_grad_copy": True}, False, ()),
    "grad_view": ({"bucket_cap_mb": 0.004, "gradient_as_bucket_view": True}, False, ()),
    "comm_hook": ({"bucket_cap_mb": 0.004}, True, ()),
    "find_unused": ({"find_unused_parameters": True}, False, (1,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_tensors_route_through_kernels(process_group, monkeypatch, case):
    kwargs, hook, unused_steps = CASES[case]
    if not torch_ddp_takes(kwargs):
        pytest.skip(f"this torch's DistributedDataParallel does not take all of {sorted(kwargs)}")
    calls = []
    real_gather, real_scatter = kernels.gather, kernels.scatter

    def gather(plan, b, tensors, out=None, *, scale=None, backend=None):
        calls.append(("gather", plan, b, out, scale, backend))
        return real_gather(plan, b, tensors, out, scale=scale, backend="reference")

    def scatter(plan, b, flat, tensors=None, *, scale=None, backend=None):
        calls.append(("scatter", plan, b, flat, scale, backend))
        return real_scatter(plan, b, flat, tensors, scale=scale, backend="reference")

    torch.manual_seed(0)
    ref = _train(torch.nn.parallel.DistributedDataParallel(_Net(), **kwargs), unused_steps=unused_steps)
    monkeypatch.setattr(kernels, "gather", gather)
    monkeypatch.setattr(kernels, "scatter", scatter)
    monkeypatch.setattr(_buckets, "_bucket_copy_backend", lambda device: "cuda")
    torch.manual_seed(0)
    ddp = HybridDDP(_Net(), **kwargs)
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    ours = _train(ddp, unused_steps=unused_steps)

    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"param {i}: {m}")
    assert all(c[5] == "cuda" for c in calls)
    # The last step ran on the final plan: one gather per bucket into the bucket's own buffer, the
    # 1/world_size scale fused in unless a comm hook (which divides itself) runs.
    last = [c for c in calls if c[1] is ddp.bucket_plan]
    gathers = [c for c in last if c[0] == "gather"]
    per_step = ddp.bucket_plan.num_buckets
    assert len(gathers) >= per_step
    assert {c[2] for c in gathers} == set(range(per_step))
    for _, _, b, out, scale, _ in gathers:
        assert out.data_ptr() == ddp._reducer.buckets.flat[b].data_ptr()
        assert scale == (None if hook else 1.0)
    scatters = [c for c in last if c[0] == "scatter"]
    if kwargs.get("gradient_as_bucket_view"):
        assert not scatters  # the gradients are the bucket's views: nothing to write back
    else:
        assert {c[2] for c in scatters} == set(range(per_step))
        for _, _, b, flat, scale, _ in scatters:
            assert flat.data_ptr() == ddp._reducer.buckets.flat[b].data_ptr() and scale is None


def test_cpu_tensors_keep_torch_copies(process_group, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("hybrid.kernels called for CPU tensors")
    monkeypatch.setattr(kernels, "gather", refuse)
    monkeypatch.setattr(kernels, "scatter", refuse)
    monkeypatch.setenv("HYBRID_KERNELS", "cuda")
    torch.manual_seed(0)
    ref = _train(torch.nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.004))
    torch.manual_seed(0)
    ours = _train(HybridDDP(_Net(), bucket_cap_mb=0.004))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not kernels.available(), reason="needs a CUDA GPU visible to torch and the "
                    "hybrid.kernels library built (python -m hybrid.kernels build)")
@pytest.mark.parametrize("case", ["default", "many_buckets", "comm_hook"])
def test_kernels_on_gpu_match_torch_ddp(process_group, monkeypatch, case):
    kwargs, hook, _ = CASES[case]
    monkeypatch.delenv("HYBRID_KERNELS", raising=False)
    torch.manual_seed(0)
    ref = _train(torch.nn.parallel.DistributedDataParallel(_Net().cuda(), **kwargs))
    torch.manual_seed(0)
    ddp = HybridDDP(_Net().cuda(), **kwargs)
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    assert ddp._reducer.buckets.kernel_copy
    ours = _train(ddp)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
