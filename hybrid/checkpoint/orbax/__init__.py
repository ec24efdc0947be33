"""orbax checkpoints (orbax-checkpoint's standard API, what flax and most JAX trainers write) in
and out of hybrid.

:class:`OrbaxCheckpoint` reads a directory ``ocp.StandardCheckpointer`` or a
``CheckpointManager`` wrote (a flax params tree and its optax state, arrays sharded over any
devices) as hybrid reads its own checkpoints (``hybrid.checkpoint.jax.load(path, ...)``
recognises it; torch's loader reads it through a mapping); :func:`write_orbax` writes any
checkpoint hybrid reads as one that orbax restores into a flax ``TrainState`` or
``{"params", "opt_state", "step"}``. See docs/checkpoints-dcp-orbax.md.

The format's plug-in (``_format.py``: recognising, opening, writing) is what the registry of
``hybrid.checkpoint`` imports; the names below are imported on first use (PEP 562), so
recognising a directory imports neither orbax nor JAX.
"""

import importlib

_WHERE = {
    "OrbaxCheckpoint": "hybrid.checkpoint.orbax._reader",
    "write_orbax": "hybrid.checkpoint._convert",  # any checkpoint, filled by hybrid.checkpoint.jax, written here
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybrid.checkpoint.orbax' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = ["OrbaxCheckpoint", "write_orbax"]
