"""torch's small DistributedDataParallel helpers that scripts and libraries call on the class or
the instance, run on torch's class and ours side by side in one gloo process."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import DistributedDataParallel as HybridDDP
from tests._procs import free_port

CLASSES = [TorchDDP, HybridDDP]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _KeepsOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

    def forward(self, x):
        self.last = self.a(x)
        return self.last


@pytest.mark.parametrize("cls", CLASSES, ids=["torch", "hybrid"])
def test_params_and_buffers_to_ignore(world_of_one, cls):
    # The static helper libraries call before wrapping: the named parameter is left out of DDP
    # (no gradient reduction, no bucket) and _get_data_parallel_params skips it, on both classes.
    model = _KeepsOutput()
    cls._set_params_and_buffers_to_ignore_for_model(model, ["b.weight"])
    ddp = cls(model)
    kept = [p for p in cls._get_data_parallel_params(model)]
    assert [id(p) for p in kept] == [id(model.a.weight), id(model.a.bias), id(model.b.bias)]
    if cls is HybridDDP:
        assert "b.weight" not in ddp._names and len(ddp._names) == 3


@pytest.mark.parametrize("clone", [True, False])
def test_sink_clone_like_torch(world_of_one, clone):
    # With find_unused_parameters the outputs pass through torch's sink, cloned unless
    # _set_ddp_sink_clone(False): the caller's tensor shares the module's storage exactly when
    # torch's does.
    shares = []
    for cls in CLASSES:
        ddp = cls(_KeepsOutput(), find_unused_parameters=True)
        ddp._set_ddp_sink_clone(clone)
        out = ddp(torch.ones(4, 3))
        shares.append(out.data_ptr() == ddp.module.last.data_ptr())
        out.sum().backward()
    assert shares[0] == shares[1] == (not clone)


def test_dataparallel_helpers_like_torch(world_of_one):
    # scatter / to_kwargs / gather, kept by torch for backward compatibility: the same results, and
    # on CPU the same refusal from gather (torch's Gather has no CPU implementation).
    x = torch.arange(6.0).reshape(3, 2)
    results = []
    for cls in CLASSES:
        ddp = cls(_KeepsOutput())
        with pytest.raises(AssertionError, match="not implemented for CPU tensors"):
            ddp.gather([x], -1)
        results.append(ddp.to_kwargs((x,), {"k": x}, 0))
    (args_t, kwargs_t), (args_h, kwargs_h) = results
    assert len(args_h) == len(args_t) and len(kwargs_h) == len(kwargs_t)
    torch.testing.assert_close(args_h[0][0], args_t[0][0], rtol=0, atol=0)
    torch.testing.assert_close(kwargs_h[0]["k"], kwargs_t[0]["k"], rtol=0, atol=0)
