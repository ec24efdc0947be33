"""_get_ddp_logging_data(): torch's own test_static_graph_api_cpu procedure, world 1 (gloo)."""
import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hybrid.torch import DistributedDataParallel as HybridDDP
from tests._procs import free_port


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cls", [TorchDDP, HybridDDP])
def test_static_graph_api_cpu(group, cls):
    torch.manual_seed(0)
    model = cls(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):
        model(torch.randn(2, 4)).sum().backward()
        model._set_static_graph()
    # torch's verify_ddp_error_logged (common_distributed.py), reproduced: it imports expecttest.
    data = model._get_ddp_logging_data()
    assert "iteration" in data and data["has_error"] == 1
    assert "should be called before training loop starts" in data["error"]
    assert data["iteration"] == 1
