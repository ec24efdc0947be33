"""hybrid.torch.DistributedDataParallel(bucket_cap_mb="auto") (issue 25.2) against torch's own
DDP at its default caps: same gradients and parameters every step; every rank ends with one plan.

Tolerance: at 2 ranks bit for bit (each element is one float32 sum of two scaled gradients, and
addition commutes, whatever the buckets). At 3 ranks gloo's ring adds the three in an order that
depends on where an element falls in its bucket's chunks, which the buckets change: the project's
float32 budget (rtol 1.3e-6, atol 1e-6, as tests/torch/test_ddp.py).
"""

import copy
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybrid.core import BucketPlan
from hybrid.torch import DistributedDataParallel as HybridDDP
from tests._procs import forkserver_ranks, free_port
from tests.torch._workers_auto import LATE_S, measured, train

RTOL, ATOL = 1.3e-6, 1e-6


def _results(target, args, world):
    reports, _ = forkserver_ranks(target, args, world, world=world, wait_s=150)
    out = [reports[r][0] for r in range(world)]
    for r, o in enumerate(out):
        assert isinstance(o, dict), f"rank {r}: {o}"
    return out


def _same(a, b, world):
    for x, y in zip(a, b):
        if world == 2:
            assert np.array_equal(x, y)
        else:
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", [2, 3])
def test_auto_caps_give_torchs_gradients(world):
    results = _results(train, (world, "patched"), world)
    assert len({r["fingerprint"] for r in results}) == 1
    first = results[0]
    assert first["in_place"] >= 1 and any(len(b) > 1 for b in first["buckets"]), first["buckets"]
    assert BucketPlan.from_json(first["plan"]).size_limits  # a plan like any other, caps per bucket
    for r in results:
        for torch_grads, our_grads in r["grads"]:
            _same(torch_grads, our_grads, world)
        for torch_params, our_params in r["params"]:
            _same(torch_params, our_params, world)


def test_ranks_that_time_gradients_differently_agree_on_one_plan():
    results = _results(train, (2, "disagree"), 2)
    assert results[0]["fingerprint"] == results[1]["fingerprint"] == results[0]["expected"]
    # the plan was made from the slowest rank's time of each gradient: rank 1's, LATE_S later from
    # tensor 2 on (half of it as the margin: a loaded machine delays either rank by milliseconds)
    order, agreed = results[0]["report"]["ready_order"], results[0]["report"]["ready_s"]
    mine = [r["mine"] for r in results]
    assert agreed == [max(mine[0][i], mine[1][i]) for i in order]
    assert sum(mine[1][i] > mine[0][i] + LATE_S / 2 for i in order) == len(order) - 2


def test_auto_caps_measured_end_to_end(tmp_path):
    results = _results(measured, (2, str(tmp_path)), 2)
    assert len({r["fingerprint"] for r in results}) == 1
    assert list(tmp_path.glob("cost-torch-*.json"))  # the probe's model, cached for the next run
    for r in results:
        for torch_grads, our_grads in r["grads"]:
            _same(torch_grads, our_grads, 2)


def test_zero2_over_auto_caps_steps_as_over_default_caps():
    results = _results(train, (2, "zero2"), 2)
    assert results[0]["in_place"] >= 1
    for r in results:
        for default_params, auto_params in r["params"]:
            _same(default_params, auto_params, 2)


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kwargs,message", [
    ({"bucket_cap_mb": "big"}, "bucket_cap_mb must be a number of MB or 'auto', got 'big'"),
    ({"bucket_cap_mb": "auto", "bucket_cap_mb_list": [1, 2]}, "cannot be combined with bucket_cap_mb_list"),
    ({"bucket_cap_mb": "auto", "find_unused_parameters": True}, "without find_unused_parameters=True"),
])
def test_auto_caps_refuse_what_they_cannot_plan(world_of_one, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HybridDDP(torch.nn.Linear(3, 2), **kwargs)


def test_auto_caps_on_one_rank_reduce_nothing_away(world_of_one):
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    ddp = HybridDDP(copy.deepcopy(local), bucket_cap_mb="auto", static_graph=True)
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        for m in (local, ddp):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        for a, b in zip(local.parameters(), ddp.module.parameters()):
            assert torch.equal(a.grad, b.grad)  # one rank: the scale is 1 and the sum is the gradient
    assert ddp._auto_report["ready_order"] and ddp.bucket_plan.num_buckets >= 1
