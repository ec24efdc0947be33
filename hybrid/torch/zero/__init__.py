"""ZeRO for torch: stage 1 (the drop-in ZeroRedundancyOptimizer), stage 2 (ZeRO2: gradients and
state sharded flat over the DDP's buckets), stage 3 (ZeRO3 + ZeRO3Optimizer: parameters sharded
too, gathered per bucket while used) and the overlap hooks that step inside the backward."""

from hybrid.torch.zero._hooks import hook_with_zero_step, hook_with_zero_step_interleaved
from hybrid.torch.zero._zero1 import ZeroRedundancyOptimizer
from hybrid.torch.zero._zero2 import ZeRO2
from hybrid.torch.zero._zero2_grads import GradientInShards
from hybrid.torch.zero.zero3._model import ZeRO3
from hybrid.torch.zero.zero3._optim import ZeRO3Optimizer
from hybrid.torch.zero.zero3._shards import ParameterInShards

__all__ = ["GradientInShards", "ParameterInShards", "ZeRO2", "ZeRO3", "ZeRO3Optimizer", "ZeroRedundancyOptimizer",
           "hook_with_zero_step", "hook_with_zero_step_interleaved"]
