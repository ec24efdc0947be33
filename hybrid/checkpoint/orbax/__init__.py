"""orbax checkpoints (orbax-checkpoint's standard API, what flax and most JAX trainers write) in
and out of hybrid.

:class:`OrbaxCheckpoint` reads a directory ``ocp.StandardCheckpointer`` or a
``CheckpointManager`` wrote (a flax params tree and its optax state, arrays sharded over any
devices) as hybrid reads its own checkpoints (``hybrid.checkpoint.jax.load(path, ...)``
recognises it; torch's loader reads it through a mapping); :func:`write_orbax` writes any
checkpoint hybrid reads as one that orbax restores into a flax ``TrainState`` or
``{"params", "opt_state", "step"}``. See docs/checkpoints.md, "Other tools' checkpoints".
"""

from hybrid.checkpoint.orbax._reader import OrbaxCheckpoint
from hybrid.checkpoint.orbax._writer import write_orbax

__all__ = ["OrbaxCheckpoint", "write_orbax"]
