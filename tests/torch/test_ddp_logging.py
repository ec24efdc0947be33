"""``_get_ddp_logging_data()`` against torch's class: every key torch fills, with torch's value,
read after construction and after each step of the same training under both classes (find_unused
with unused parameters, static_graph, gradient_as_bucket_view, comm hooks, no_sync, join with
uneven inputs, skip_all_reduce_unused_params, a sample rate, a changing graph, pickling, errors).

Timings are host times in nanoseconds: compared by presence, type, and being positive where
torch's are (their values differ run to run); every other value must be equal.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(__file__))
import _workers_logging  # noqa: E402
from test_ddp import LazyWorlds, side_by_side_results  # noqa: E402

from hybrid.torch import DistributedDataParallel as HybridDDP  # noqa: E402
from tests._procs import free_port  # noqa: E402

WORLD_SIZES = (1, 2, 3)
TIMESTAMPS = ("forward_compute_time_start", "backward_compute_time_start", "backward_comm_time_start",
              "backward_compute_time_end", "backward_comm_time_end")
TIMINGS = {*TIMESTAMPS, "forward_compute_time", "backward_compute_time", "backward_comm_time",
           "backward_compute_comm_overlap_time", "avg_forward_compute_time", "avg_backward_compute_time",
           "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time"}


@pytest.fixture(scope="module")
def runs():
    return LazyWorlds(_workers_logging.logging_worker,
                      [*_workers_logging.CASES, *_workers_logging.ERROR_CASES], "logging")


def assert_like_torch(ours: dict, ref: dict, where: str = "") -> None:
    """Same keys; same values, timings aside: those positive exactly where torch's are."""
    assert sorted(ours) == sorted(ref), f"{where}: missing {set(ref) - set(ours)}, extra {set(ours) - set(ref)}"
    for key, value in ref.items():
        if key in TIMINGS:
            assert type(ours[key]) is int and (ours[key] > 0) == (value > 0), (where, key, ours[key], value)
        else:
            assert ours[key] == value, (where, key, ours[key], value)
    if all(ref.get(k) for k in TIMESTAMPS):
        # torch's own test: host-side times in the order the events happen (unless the sampled
        # iteration failed before its end: then torch's too are out of order).
        assert _in_order(ours) == _in_order(ref), (where, [(k, ours[k], ref[k]) for k in TIMESTAMPS])


def _in_order(data: dict) -> bool:
    fwd, comp_start, comm_start, comp_end, comm_end = (data[k] for k in TIMESTAMPS)
    return fwd <= comp_start <= comm_start <= comm_end and comp_start <= comp_end


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(_workers_logging.CASES))
def test_logging_data_like_torch_after_every_step(runs, world, case):
    for rank, (ref, ours) in enumerate(side_by_side_results(runs, world, case)):
        assert len(ours) == len(ref)
        for step, (a, b) in enumerate(zip(ours, ref)):
            assert_like_torch(a, b, f"rank {rank}, read {step}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sampled_iterations_like_torch(runs, world):
    # torch's test_ddp_logging_data_cpu with sample rate 2: after step idx (idx > 0) the logged
    # iteration is idx when idx < 10 or idx is even, else an earlier one. Sampled at a forward,
    # the stats are those of the iterations before it.
    for _, ours in side_by_side_results(runs, world, "sample_rate"):
        for idx, data in enumerate(ours[2:]):
            if idx > 0 and (idx < 10 or idx % 2 == 0):
                assert data["iteration"] == idx
                assert data["forward_compute_time"] >= 1 and data["backward_comm_time"] >= 1
                assert data["backward_compute_time"] >= data["backward_compute_comm_overlap_time"]
            elif idx > 0:
                assert data["iteration"] != idx


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(_workers_logging.ERROR_CASES))
def test_errors_logged_like_torch(runs, world, case):
    # torch's verify_ddp_error_logged: 'iteration', 'has_error' and 'error' holding the message
    # raised. The texts' first lines agree (ours may name the parameters where torch advises to
    # turn debugging on); every other key equals torch's.
    for ref, ours in side_by_side_results(runs, world, case):
        assert_error_logged_like_torch(ours, ref, case)


def assert_error_logged_like_torch(ours: dict, ref: dict, where: str = "") -> None:
    """``{"error": text raised, "log": logging data after it}`` of ours and torch's: where torch
    logs the error, ours too, its first line starting as torch's (ours may go on where torch's
    stops, naming the parameter); every other key as :func:`assert_like_torch` wants."""
    assert ("error" in ours["log"]) == ("error" in ref["log"]), (where, ours["log"].get("error"), ref["error"])
    if "error" in ref["log"]:
        assert ours["error"] in ours["log"]["error"] and ref["error"] in ref["log"]["error"]
        assert ours["log"]["error"].splitlines()[0].startswith(ref["log"]["error"].splitlines()[0]), where
    assert_like_torch({**ours["log"], "error": None}, {**ref["log"], "error": None}, where)


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


class _Net(nn.Module):
    """torch's distributed_test.Net: three layers, the last one's bias off."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return torch.softmax(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))), dim=1)


@pytest.mark.parametrize("cls", [TorchDDP, HybridDDP], ids=["torch", "hybrid"])
def test_static_graph_api_cpu(group, cls):
    # torch's own test (distributed_test.py), its verify_ddp_error_logged inlined (the module
    # imports expecttest): _set_static_graph() after an iteration raises, and the error is logged.
    torch.manual_seed(0)
    model = cls(_Net())
    expected_err = "should be called before training loop starts"
    with pytest.raises(RuntimeError, match=expected_err):
        x, y = torch.randn(2, 2), torch.randn(2, 4)
        nn.MSELoss()(model(x), y).backward()
        model._set_static_graph()
    data = model._get_ddp_logging_data()
    for key in ("iteration", "has_error", "error"):
        assert key in data, f"Expected '{key}' in ddp_logging_data"
    assert expected_err in data["error"]
    assert data["iteration"] == 1 and data["has_error"] == 1


@pytest.mark.parametrize("cls", [TorchDDP, HybridDDP], ids=["torch", "hybrid"])
def test_no_reducer_no_logger(group, cls):
    # Every trainable parameter delayed (delay_all_reduce_named_params): torch builds no reducer,
    # hence no logger, and says so.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ddp = cls(model, delay_all_reduce_named_params=named, param_to_hook_all_reduce=model[0].bias)
    with pytest.raises(AssertionError, match="self.logger must not be None"):
        ddp._get_ddp_logging_data()
