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
import re
import shutil

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
            path = pathlib.Path(os.path.abspath(path))
            step = manager_step(path)
            if step is None:
                with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the save, ends its threads
                    checkpointer.save(path, source)
                return
            # A CheckpointManager's step directory (root/5): written by a manager, so that its
            # restore(5) finds the item "default" and the step's metadata, then moved into place.
            scratch = path.parent / f".{path.name}.manager"
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                with ocp.CheckpointManager(scratch) as manager:
                    manager.save(step, args=ocp.args.StandardSave(source))
                    manager.wait_until_finished()
                os.rename(scratch / str(step), path)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return write


def manager_step(path: pathlib.Path) -> int | None:
    """The step of a CheckpointManager's step directory a writer is given (``root/5``, or the
    hidden ``root/.5.converting`` that ``convert`` writes first), or None for any other name.

    >>> manager_step(pathlib.Path("run/5")), manager_step(pathlib.Path("run/.12.converting")), manager_step(pathlib.Path("run/o"))
    (5, 12, None)
    """
    found = re.fullmatch(r"(\d+)|\.(\d+)\.converting", path.name)
    return None if found is None else int(found.group(1) or found.group(2))


FORMAT = OrbaxFormat()
