"""The drop-in classes take exactly torch's constructor arguments: names, order, kinds, defaults.

Annotations are left out of the comparison: ours are plain, torch's name private types.
"""

import inspect

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer


def _shape(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("ours, theirs", [
    (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel),
    (ZeroRedundancyOptimizer, TorchZero),
], ids=["DistributedDataParallel", "ZeroRedundancyOptimizer"])
def test_constructor_matches_torch(ours, theirs):
    assert _shape(ours.__init__) == _shape(theirs.__init__)


def test_ddp_public_methods_exist_like_torch():
    wanted = ["no_sync", "join", "join_hook", "register_comm_hook", "forward", "state_dict",
              "load_state_dict", "named_parameters", "_set_static_graph", "_register_builtin_comm_hook",
              "will_sync_module_buffers", "_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate",
              "__getstate__", "__setstate__"]
    missing = [m for m in wanted if not callable(getattr(DistributedDataParallel, m, None))]
    assert not missing, missing
