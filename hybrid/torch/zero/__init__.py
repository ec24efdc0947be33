"""ZeRO for torch: stage 1 (the drop-in ZeroRedundancyOptimizer), stage 2 (ZeRO2: gradients and
state sharded flat over the DDP's buckets) and the overlap hooks that step inside the backward."""

from hybrid.torch.zero._hooks import hook_with_zero_step, hook_with_zero_step_interleaved
from hybrid.torch.zero._zero1 import ZeroRedundancyOptimizer
from hybrid.torch.zero._zero2 import ZeRO2
from hybrid.torch.zero._zero2_grads import GradientInShards

__all__ = ["GradientInShards", "ZeRO2", "ZeroRedundancyOptimizer", "hook_with_zero_step",
           "hook_with_zero_step_interleaved"]
