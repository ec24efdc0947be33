"""ZeRO2's docstring example and its input errors, in one gloo process."""

import doctest

import pytest
import torch
import torch.distributed as dist

import hybrid.torch._flat
import hybrid.torch.zero._clip
import hybrid.torch.zero._zero2
import hybrid.torch.zero._zero2_grads
import hybrid.torch.zero._hooks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import hybrid.torch
from hybrid.torch import DistributedDataParallel, ZeRO2, ZeroRedundancyOptimizer
from tests._procs import free_port


@pytest.mark.parametrize("module", [hybrid.torch._flat, hybrid.torch.zero._zero2, hybrid.torch.zero._zero2_grads,
                                    hybrid.torch.zero._hooks, hybrid.torch.zero._clip])
def test_module_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("make_module, optimizer_class, ddp_kwargs, error, match", [
    (lambda m: m, torch.optim.SGD, None, TypeError, "hybrid.torch.DistributedDataParallel module, got Linear"),
    (lambda m: torch.nn.parallel.DistributedDataParallel(m), torch.optim.SGD, None, TypeError,
     "got DistributedDataParallel"),
    (None, "sgd", {}, TypeError, "optimizer_class must be a torch.optim.Optimizer subclass, got 'sgd'"),
    (None, torch.optim.SGD, {"find_unused_parameters": True}, NotImplementedError, "find_unused_parameters"),
])
def test_errors(world_of_one, make_module, optimizer_class, ddp_kwargs, error, match):
    model = torch.nn.Linear(3, 2)
    module = make_module(model) if make_module else DistributedDataParallel(model, **ddp_kwargs)
    with pytest.raises(error, match=match):
        ZeRO2(module, optimizer_class, lr=0.1)


def test_one_hook_per_ddp(world_of_one):
    ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
    ZeRO2(ddp, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="can only be called once"):
        ZeRO2(ddp, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("hook", ["hook_with_zero_step", "hook_with_zero_step_interleaved"])
@pytest.mark.parametrize("make_zero, error, match", [
    (lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1), ValueError, "overlap_with_ddp=True"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), TypeError, "got SGD"),
    (lambda m: ZeroRedundancyOptimizer([{"params": [m.weight]}, {"params": [m.bias]}], torch.optim.SGD,
                                       overlap_with_ddp=True, lr=0.1), ValueError, "single parameter group, got 2"),
])
def test_overlap_hook_errors(world_of_one, hook, make_zero, error, match):
    ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
    with pytest.raises(error, match=match):
        getattr(hybrid.torch, hook)(allreduce_hook, ddp, make_zero(ddp.module))


@pytest.mark.parametrize("make_groups, error, match", [
    (lambda m: [{"params": [m.weight]}], ValueError, r"parameters in no group: \['bias'\]"),
    (lambda m: [{"params": [m.weight, m.bias]}, {"params": m.bias}], ValueError,
     r"parameter 'bias' appears in param_groups\[0\] and param_groups\[1\]"),
    (lambda m: [{"params": [m.weight, m.bias, torch.nn.Parameter(torch.ones(5))]}], ValueError,
     r"param_groups\[0\] holds a tensor of shape \(5,\) that is not a parameter of the DDP module"),
    (lambda m: [[m.weight, m.bias]], TypeError, r"param_groups\[0\] must be a dict with a 'params' entry"),
])
def test_param_group_errors(world_of_one, make_groups, error, match):
    ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
    with pytest.raises(error, match=match):
        ZeRO2(ddp, torch.optim.SGD, param_groups=make_groups(ddp.module), lr=0.1)


def test_load_state_dict_with_other_groups_raises(world_of_one):
    ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
    opt = ZeRO2(ddp, torch.optim.Adam, lr=0.1)
    plain = torch.optim.Adam([{"params": [ddp.module.weight]}, {"params": [ddp.module.bias]}], lr=0.1)
    with pytest.raises(ValueError, match=r"groups of \[1, 1\] parameters, this optimizer \[2\]"):
        opt.load_state_dict(plain.state_dict())


class _SparseTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4, sparse=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.table(ids))


@pytest.mark.parametrize("make", [
    lambda ddp: ZeRO2(ddp, torch.optim.SGD, lr=0.1),
    lambda ddp: hybrid.torch.hook_with_zero_step(allreduce_hook, ddp, ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)),
    lambda ddp: hybrid.torch.hook_with_zero_step_interleaved(allreduce_hook, ddp, ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)),
])
def test_sparse_gradients_are_refused_by_name(world_of_one, make):
    # A sparse gradient sits alone in its DDP bucket; ZeRO2 and the overlap hooks shard flat dense
    # buckets. They used to fail in the middle of the first backward (as_strided on a sparse
    # tensor, a data pointer without storage); now at construction, naming the parameter.
    ddp = DistributedDataParallel(_SparseTable())
    with pytest.raises(NotImplementedError, match="does not support sparse gradients: parameter 'table.weight'"):
        make(ddp)
