"""torch.compile of hybrid's DDP: graphs split at the bucket plan's boundaries (torch's
DDPOptimizer, from hybrid.core's graph split), and ``hybrid.torch.compile`` for plain modules."""

from hybrid.torch.dynamo._compile import SplitBackend, SplitReport, compile, split_reports

__all__ = ["SplitBackend", "SplitReport", "compile", "split_reports"]
