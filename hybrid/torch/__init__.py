"""torch frontend: drop-ins for torch's data-parallel classes, executing hybrid.core plans."""

from hybrid.torch._cost_probe import measure_collectives
from hybrid.torch._compile import SplitBackend, SplitReport, compile, split_reports
from hybrid.torch._ddp import DistributedDataParallel
from hybrid.torch._ddp import GradBucket
from hybrid.torch._ddp import specs
from hybrid.torch._zero import ZeroRedundancyOptimizer
from hybrid.torch._zero2 import ZeRO2
from hybrid.torch._zero2_grads import GradientInShards
from hybrid.torch._zero_hooks import hook_with_zero_step
from hybrid.torch._zero_hooks import hook_with_zero_step_interleaved

__all__ = ["DistributedDataParallel", "GradBucket", "GradientInShards", "SplitBackend", "SplitReport", "ZeRO2",
           "ZeroRedundancyOptimizer", "compile", "hook_with_zero_step", "hook_with_zero_step_interleaved", "measure_collectives", "specs",
           "split_reports"]
