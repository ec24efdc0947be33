"""torch frontend: drop-in DistributedDataParallel executing hybrid.core bucket plans."""

from hybrid.torch._ddp import DistributedDataParallel
from hybrid.torch._ddp import GradBucket
from hybrid.torch._ddp import specs

__all__ = ["DistributedDataParallel", "GradBucket", "specs"]
