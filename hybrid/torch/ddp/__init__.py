"""The drop-in DistributedDataParallel: torch's constructor, methods and hook protocol, over a
reducer whose buckets are hybrid.core plans."""

from hybrid.torch.ddp._ddp import DistributedDataParallel
from hybrid.torch.ddp._parts import GradBucket, specs

__all__ = ["DistributedDataParallel", "GradBucket", "specs"]
