"""torch frontend: drop-ins for torch's data-parallel classes, executing hybrid.core plans."""

from hybrid.torch._zero import ZeroRedundancyOptimizer
