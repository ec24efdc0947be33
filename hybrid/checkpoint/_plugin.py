"""The interface every checkpoint format implements: recognise its directories, open one for
reading, write one.

As torch's distributed checkpoint keeps ``load`` / ``save`` apart from its ``StorageReader`` /
``StorageWriter``, the format-neutral layer here (``open_checkpoint``, ``convert``, the torch and
JAX loaders) reaches a format only through a :class:`CheckpointFormat`, found by name in the
registry of ``_formats.py``. A format is a folder (or a module) holding its reader, its writer and
one ``FORMAT = ...`` instance, plus one registration line there. A format imports this interface
and the shared pieces below it (``_reader``, ``_foreign``, ``_manifest``, ...), never the
dispatcher (``_formats``, ``_convert``) back: ``tests/checkpoint_formats/test_registry.py`` checks.

The module defining ``FORMAT`` is imported to recognise a directory, so it imports nothing heavy:
its ``detect`` looks at file names, and ``open`` / ``writer`` import the reader and the writer
(and torch, JAX or orbax with them) when called.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable


class CheckpointFormat:
    """A checkpoint format (see the module docstring).

    Attributes:
      name: what ``format=``, ``to=`` and ``--from`` / ``--to`` call it.
      signature: the files that give it away, for the error about a directory no format claims.
      writes_jax_tree: its writer takes a JAX train state ``{"params", "opt_state", "step"}``
        (built by ``hybrid.checkpoint.jax`` from ``like=`` and ``mapping=``) instead of the opened
        checkpoint; a mapping then places torch's names into that tree rather than renaming the
        source.
    """

    name: str
    signature: str
    writes_jax_tree: bool = False

    def detect(self, path: pathlib.Path) -> bool:
        """Whether the directory at ``path`` (a checkpoint path, not yet resolved) is of this format."""
        raise NotImplementedError

    def open(self, path: str | os.PathLike, *, step: int | None = None, param_names=None, **options):
        """A ``hybrid.checkpoint.CheckpointReader`` of the checkpoint at ``path``.

        Args:
          step: the training step, for a checkpoint that records none.
          param_names: the receiving model's parameter names (a format may need them to tell
            parameters from buffers).
          options: the format's own (DCP's ``model_key``; orbax's ``params_key``).
        """
        raise NotImplementedError

    def writer(self, source, **options) -> Callable[[pathlib.Path], None]:
        """Read and check everything the new checkpoint needs from ``source`` (an opened checkpoint,
        or the JAX train state where ``writes_jax_tree``), then return what writes it at a path
        that does not exist yet. ``options`` are ``convert``'s (``world_size``, ``param_groups``)
        and the format's own; a format ignores the ones it has no use for."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name!r}>"
