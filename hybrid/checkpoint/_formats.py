"""Which tool wrote a checkpoint directory, and the reader for it: the registry of formats.

Every loader (``hybrid.checkpoint.torch.load``, ``hybrid.checkpoint.jax.load``, ``convert``)
opens its checkpoint through :func:`open_checkpoint`, so each reads hybrid's own directories,
torch DCP's and orbax's alike; ``format=`` insists on one.

A format is registered by name and the module holding its :class:`CheckpointFormat` (``FORMAT``),
imported the first time the format is asked for: recognising a hybrid directory imports no
other format, and a DCP directory neither JAX nor orbax. A new format is a folder with its
reader, writer and ``FORMAT``, and one line below. Formats never import this module back.
"""

from __future__ import annotations

import importlib
import os

from hybrid.checkpoint._manifest import CheckpointError
from hybrid.checkpoint._plugin import CheckpointFormat
from hybrid.checkpoint._protocol import resolve
from hybrid.checkpoint._reader import CheckpointReader

_MODULES: dict[str, str] = {}  # name -> the module defining its FORMAT, in the order detection asks
_LOADED: dict[str, CheckpointFormat] = {}


def register(name: str, module: str) -> None:
    """Make the format ``FORMAT`` of ``module`` (imported on first use) known as ``name``."""
    if name in _MODULES and _MODULES[name] != module:
        raise ValueError(f"checkpoint format {name!r} is already registered by {_MODULES[name]}")
    _MODULES[name] = module


register("hybrid", "hybrid.checkpoint._hybrid_format")
register("dcp", "hybrid.checkpoint.dcp._format")
register("orbax", "hybrid.checkpoint.orbax._format")

FORMATS = tuple(_MODULES)  # hybrid's own formats; registered(): these and any registered since


def registered() -> tuple[str, ...]:
    """The names of the registered formats, in the order detection asks them.

    >>> registered()[:3]
    ('hybrid', 'dcp', 'orbax')
    """
    return tuple(_MODULES)


def format_named(name: str) -> CheckpointFormat:
    """The registered format ``name`` (its module imported now if it was not yet).

    >>> format_named("dcp").signature
    '.metadata (torch DCP)'
    """
    if name not in _MODULES:
        raise ValueError(f"format={name!r}; hybrid reads and writes {list(registered())}")
    if name not in _LOADED:
        fmt = importlib.import_module(_MODULES[name]).FORMAT
        if fmt.name != name:
            raise ValueError(f"{_MODULES[name]}.FORMAT is named {fmt.name!r}, registered as {name!r}")
        _LOADED[name] = fmt
    return _LOADED[name]


def detect_format(path: str | os.PathLike) -> str:
    """``"hybrid"``, ``"dcp"`` or ``"orbax"``: what wrote the checkpoint directory ``path``.

    >>> import numpy as np, tempfile
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save_arrays(d, {"w": np.zeros(2, np.float32)})
    >>> detect_format(d)
    'hybrid'
    """
    for name in registered():  # hybrid's own first: a save in progress has no directory at path yet
        if format_named(name).detect(path):
            return name
    if not resolve(path).is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory there")
    signatures = [format_named(name).signature for name in registered()]
    raise CheckpointError(f"{path}: not a checkpoint hybrid reads: no {', '.join(signatures[:-1])} "
                          f"or {signatures[-1]}")


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
    if format is not None and format not in _MODULES:
        raise ValueError(f"format={format!r}; hybrid reads {list(registered())}")
    found = detect_format(path)
    if format is not None and found != format:
        raise CheckpointError(f"{path}: holds a {found} checkpoint, format={format!r} was asked for")
    return format_named(found).open(path, step=step, param_names=param_names, **options)
