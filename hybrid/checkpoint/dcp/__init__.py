"""torch's distributed checkpoints (``torch.distributed.checkpoint``, what FSDP2 and torchtitan
write) in and out of hybrid.

:class:`DcpCheckpoint` reads a directory ``dcp.save`` wrote from ``get_state_dict(model,
optimizer)`` as hybrid reads its own checkpoints (every loader takes it, or recognises the
directory: ``hybrid.checkpoint.torch.load(path, ...)``); :func:`write_dcp` writes a checkpoint
that torch's own ``dcp.load`` and ``set_state_dict`` read into an FSDP2 (or any) model and
optimizer. See docs/checkpoints.md, "Other tools' checkpoints".
"""

from hybrid.checkpoint.dcp._reader import DcpCheckpoint
from hybrid.checkpoint.dcp._writer import write_dcp

__all__ = ["DcpCheckpoint", "write_dcp"]
