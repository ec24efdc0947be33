"""torch frontend: drop-ins for torch's data-parallel classes, executing hybrid.core plans.

Parts: ``ddp/`` (DistributedDataParallel and its reducer), ``zero/`` (ZeRO stages and the overlap
hooks), ``dynamo/`` (torch.compile support, which plugs into DDP's forward); beside them the
collectives that fail loudly, flat parameter buffers and the cost probe, which all parts share.
"""

from hybrid.torch._cost_probe import measure_collectives
from hybrid.torch._ready import gradient_ready_order
from hybrid.torch.ddp import DistributedDataParallel, GradBucket, specs
from hybrid.torch.dynamo import SplitBackend, SplitReport, compile, split_reports
from hybrid.torch.zero import (GradientInShards, ParameterInShards, ZeRO2, ZeRO3, ZeRO3Optimizer,
                               ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved)

__all__ = ["DistributedDataParallel", "GradBucket", "GradientInShards", "ParameterInShards", "SplitBackend",
           "SplitReport", "ZeRO2", "ZeRO3", "ZeRO3Optimizer", "ZeroRedundancyOptimizer", "compile",
           "gradient_ready_order", "hook_with_zero_step", "hook_with_zero_step_interleaved", "measure_collectives",
           "specs", "split_reports"]
