"""On a GPU: hybrid's DDP and ZeRO over an NCCL process group, against torch's classes.

The rest of tests/torch runs on gloo and CPU tensors (this project's machines have no GPU). Here
the same small training loop runs on CUDA tensors through NCCL, one rank (one GPU is what a lent
machine has; NCCL refuses two ranks on one device), with the batched-copy kernels on the bucket
path when they are built. Skipped, with the reason, without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

from hybrid import kernels
from hybrid.torch import DistributedDataParallel as HybridDDP
from hybrid.torch import ZeroRedundancyOptimizer as HybridZeRO
from tests.torch.test_ddp_kernels import CASES, _Net, _train, single_rank_group, torch_ddp_takes

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU and torch built with NCCL")

# float32, one rank (no reduction arithmetic), the same kernels on both sides: the project's
# float32 same-framework budget, though the runs are expected to agree bit for bit.
RTOL, ATOL = 1.3e-6, 1e-6


@pytest.fixture(scope="module")
def nccl_group():
    torch.cuda.set_device(0)
    with single_rank_group("nccl", device_id=torch.device("cuda", 0)):
        yield


def _assert_same(ours, ref):
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_ddp_over_nccl_matches_torch(nccl_group, case):
    kwargs, hook, unused_steps = CASES[case]
    if not torch_ddp_takes(kwargs):
        pytest.skip(f"this torch's DistributedDataParallel does not take all of {sorted(kwargs)}")
    torch.manual_seed(0)
    ref = _train(torch.nn.parallel.DistributedDataParallel(_Net().cuda(), **kwargs), steps=5,
                 unused_steps=unused_steps)
    torch.manual_seed(0)
    ddp = HybridDDP(_Net().cuda(), **kwargs)
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    # with the library built, CUDA buckets go through the kernels; without it, torch's copies
    assert ddp._reducer.buckets.kernel_copy == kernels.available()
    _assert_same(_train(ddp, steps=5, unused_steps=unused_steps), ref)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_zero_over_nccl_matches_torch(nccl_group, optimizer):
    def run(zero_class, ddp_class):
        torch.manual_seed(0)
        ddp = ddp_class(_Net().cuda())
        opt = zero_class(ddp.parameters(), optimizer_class=optimizer, lr=0.01)
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            ddp(torch.randn(6, 8, generator=g).cuda()).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in ddp.module.parameters()]

    _assert_same(run(HybridZeRO, HybridDDP), run(TorchZeRO, torch.nn.parallel.DistributedDataParallel))
