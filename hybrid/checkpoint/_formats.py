"""Which tool wrote a checkpoint directory, and the reader for it.

Every loader (``hybrid.checkpoint.torch.load``, ``hybrid.checkpoint.jax.load``, ``convert``)
opens its checkpoint through :func:`open_checkpoint`, so each reads hybrid's own directories,
torch DCP's and orbax's alike; ``format=`` insists on one.
"""

from __future__ import annotations

import os
import pathlib

from hybrid.checkpoint._manifest import MANIFEST, CheckpointError
from hybrid.checkpoint._protocol import previous, resolve
from hybrid.checkpoint._reader import CheckpointReader

FORMATS = ("hybrid", "dcp", "orbax")
_ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def _orbax_steps(path: pathlib.Path) -> bool:
    """Whether ``path`` is an orbax CheckpointManager's directory: step directories of checkpoints."""
    return any(p.name.isdigit() and p.is_dir() and any((p / m).exists() for m in _ORBAX_MARKERS)
               for p in path.iterdir())


def detect_format(path: str | os.PathLike) -> str:
    """``"hybrid"``, ``"dcp"`` or ``"orbax"``: what wrote the checkpoint directory ``path``.

    >>> import numpy as np, tempfile
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save_arrays(d, {"w": np.zeros(2, np.float32)})
    >>> detect_format(d)
    'hybrid'
    """
    target = resolve(path)
    if (target / MANIFEST).exists() or (previous(path) / MANIFEST).exists():
        return "hybrid"
    if not target.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory there")
    if any(target.glob("rank-*.safetensors")):  # hybrid's files without a manifest: its reader says why
        return "hybrid"
    if (target / ".metadata").exists():
        return "dcp"
    if any((target / m).exists() for m in _ORBAX_MARKERS) or _orbax_steps(target):
        return "orbax"
    raise CheckpointError(f"{path}: not a checkpoint hybrid reads: no manifest.json (hybrid), .metadata (torch DCP) "
                          f"or _METADATA / _CHECKPOINT_METADATA (orbax)")


def open_checkpoint(path, *, format: str | None = None, step: int | None = None, param_names=None,
                    **options) -> CheckpointReader:
    """The checkpoint at ``path`` opened for reading, by the reader of the tool that wrote it.

    Args:
      path: a checkpoint directory, or a reader already opened (given back as it is).
      format: ``"hybrid"``, ``"dcp"`` or ``"orbax"`` to insist on one (default: recognised).
      step: for a foreign checkpoint, the training step where it records none (an orbax
        CheckpointManager's directory: which step to open, default its latest).
      param_names: the receiving model's parameter names (a DCP model's other tensors are buffers).
      options: for the format's reader (DCP's ``model_key``; orbax's ``params_key``).

    >>> import numpy as np, tempfile
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save_arrays(d, {"w": np.zeros(2, np.float32)}, step=4)
    >>> ckpt = open_checkpoint(d)
    >>> ckpt.format, ckpt.manifest.step
    ('hybrid', 4)
    """
    if isinstance(path, CheckpointReader):
        if format not in (None, path.format):
            raise CheckpointError(f"{path.path}: is a {path.format} checkpoint, format={format!r} was asked for")
        return path
    if format is not None and format not in FORMATS:
        raise ValueError(f"format={format!r}; hybrid reads {list(FORMATS)}")
    found = detect_format(path)
    if format is not None and found != format:
        raise CheckpointError(f"{path}: holds a {found} checkpoint, format={format!r} was asked for")
    if found == "hybrid":
        if step is not None or options:
            raise ValueError(f"open_checkpoint: {sorted(['step'] * (step is not None) + list(options))} are for "
                             f"foreign checkpoints; {path} is hybrid's own")
        from hybrid.checkpoint._files import Checkpoint
        return Checkpoint(path)
    if found == "dcp":
        from hybrid.checkpoint.dcp import DcpCheckpoint
        return DcpCheckpoint(path, step=step, param_names=param_names, **options)
    from hybrid.checkpoint.orbax import OrbaxCheckpoint
    return OrbaxCheckpoint(path, step=step, **options)
