"""orbax as a plug-in: a directory orbax's ``StandardCheckpointer`` or a ``CheckpointManager``
wrote (``_METADATA``, ``_CHECKPOINT_METADATA``, ``manifest.ocdbt``, or step directories holding
them), read by :class:`OrbaxCheckpoint` and written by orbax's own ``StandardCheckpointer`` from
a JAX train state ``{"params", "opt_state", "step"}`` (the fields of flax's ``TrainState``).
The tree is built before the writer is called (``hybrid.checkpoint.jax._train_state``), so this
format imports neither the JAX loader nor the dispatcher. Recognising a directory imports nothing;
opening one imports orbax and JAX when its arrays are read."""

from __future__ import annotations

import os
import pathlib

from hybrid.checkpoint._plugin import CheckpointFormat
from hybrid.checkpoint._protocol import resolve

MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def _manager_steps(path: pathlib.Path) -> bool:
    """Whether ``path`` is an orbax CheckpointManager's directory: step directories of checkpoints."""
    return any(p.name.isdigit() and p.is_dir() and any((p / m).exists() for m in MARKERS) for p in path.iterdir())


class OrbaxFormat(CheckpointFormat):
    name = "orbax"
    signature = "_METADATA / _CHECKPOINT_METADATA (orbax)"
    writes_jax_tree = True

    def detect(self, path) -> bool:
        target = resolve(path)
        return target.is_dir() and (any((target / m).exists() for m in MARKERS) or _manager_steps(target))

    def open(self, path, *, step=None, param_names=None, **options):
        from hybrid.checkpoint.orbax._reader import OrbaxCheckpoint

        del param_names  # a JAX tree: parameters are under params_key
        return OrbaxCheckpoint(path, step=step, **options)

    def writer(self, source, **options):
        """``source``, the train state, saved by orbax's ``StandardCheckpointer``."""
        import orbax.checkpoint as ocp

        del options  # the tree was laid out by like= / mapping= before

        def write(path: pathlib.Path) -> None:
            with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the save, ends its threads
                checkpointer.save(os.path.abspath(path), source)
        return write


FORMAT = OrbaxFormat()
