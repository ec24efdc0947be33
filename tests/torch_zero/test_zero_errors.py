"""Input errors: same exception type and text as torch's ZeroRedundancyOptimizer.

Both classes check their input before touching a process group, so no world is needed (but for
the functional-optimizer check, which torch makes after finding the default group).
"""

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from hybrid.torch import ZeroRedundancyOptimizer


def _p(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))


BAD_INPUTS = {
    "empty list": lambda: [],
    "empty generator": lambda: iter(()),
    "a tensor": lambda: _p(3),
    "a float": lambda: 3.0,
    "non-tensor in list": lambda: [_p(3), 1.0],
    "dict without params": lambda: [{"lr": 0.1}],
    "tensors and dicts": lambda: [_p(3), {"params": [_p(2)]}],
    "sparse": lambda: [torch.zeros(3, 3).to_sparse().requires_grad_()],
    "mixed dense dtypes": lambda: [_p(3), _p(2, dtype=torch.float64)],
    "mixed dtypes across groups": lambda: [{"params": [_p(3)]}, {"params": [_p(2, dtype=torch.float16)]}],
}


def _error(cls, params):
    with pytest.raises((TypeError, ValueError)) as info:
        cls(params, torch.optim.SGD, lr=0.1)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_input_errors_match_torch(case):
    ours, theirs = _error(ZeroRedundancyOptimizer, BAD_INPUTS[case]()), _error(TorchZero, BAD_INPUTS[case]())
    assert ours == theirs



def test_a_functional_optimizer_without_overlap_is_refused_as_torch_does():
    """A functional optimizer class without ``overlap_with_ddp``. torch checks it after finding
    the default group, so this one needs a (one-rank) group."""
    from torch.distributed.optim.functional_adam import _FunctionalAdam

    from tests.torch.test_ddp_kernels import single_rank_group

    def error(cls):
        with pytest.raises(ValueError) as info:
            cls([_p(3)], _FunctionalAdam, lr=0.1)
        return str(info.value)
    with single_rank_group("gloo"):
        ours, theirs = error(ZeroRedundancyOptimizer), error(TorchZero)
    assert ours == theirs and "Passing in a functional optimizer" in ours


@pytest.mark.parametrize("flag, checks", [(None, 1), (True, 1), (False, 0)])
def test_the_per_step_cross_rank_check_is_one_all_reduce_and_can_be_left_out(flag, checks, monkeypatch):
    """``step()``'s cross-rank check is the only all-reduce a step issues: on CPU parameters it
    runs by default; ``check_ranks_each_step=False`` leaves it out (what the default does on a GPU,
    where reading it waits for the backward) and the step's result is the same. One rank."""
    import torch.distributed as dist

    from tests.torch.test_ddp_kernels import single_rank_group

    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with single_rank_group("gloo"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, check_ranks_each_step=flag, lr=0.1)
        reference = torch.optim.SGD([p.detach().clone().requires_grad_() for p in model.parameters()], lr=0.1)
        for p, q in zip(model.parameters(), reference.param_groups[0]["params"]):
            p.grad = q.grad = torch.ones_like(p)
        calls.clear()  # the constructor's check always runs
        opt.step()
        reference.step()
        assert len(calls) == checks, calls
        for p, q in zip(model.parameters(), reference.param_groups[0]["params"]):
            assert torch.equal(p, q)  # same update either way: the check reads, never writes
