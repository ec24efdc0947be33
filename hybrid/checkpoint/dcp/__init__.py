"""torch's distributed checkpoints (``torch.distributed.checkpoint``, what FSDP2 and torchtitan
write) in and out of hybrid.

:class:`DcpCheckpoint` reads a directory ``dcp.save`` wrote from ``get_state_dict(model,
optimizer)`` as hybrid reads its own checkpoints (every loader takes it, or recognises the
directory: ``hybrid.checkpoint.torch.load(path, ...)``); :func:`write_dcp` writes a checkpoint
that torch's own ``dcp.load`` and ``set_state_dict`` read into an FSDP2 (or any) model and
optimizer. See docs/checkpoints-dcp-orbax.md.

The format's plug-in (``_format.py``: recognising, opening, writing) is what the registry of
``hybrid.checkpoint`` imports; the names below are imported on first use (PEP 562), so
recognising a directory imports no torch.
"""

import importlib

_WHERE = {
    "DcpCheckpoint": "hybrid.checkpoint.dcp._reader",
    "write_dcp": "hybrid.checkpoint._convert",  # any checkpoint, opened through the registry, written here
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybrid.checkpoint.dcp' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = ["DcpCheckpoint", "write_dcp"]
