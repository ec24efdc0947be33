"""DCP's metadata classes as plain records, which ``_metadata``'s unpickler builds in their place.

The real ones live in ``torch.distributed.checkpoint``, whose package ``__init__`` imports DCP's
planners, state-dict helpers and ``torch.export`` with them: on these machines as long again as
torch itself. Reading a checkpoint's metadata needs none of it (``checkpoint info`` of a DCP
directory), so the allow-listed dataclasses are unpickled into records holding the same fields
under the same names; torch's own types inside them (``torch.Size``, dtypes) stay torch's.
"""

from __future__ import annotations

import torch

# TensorProperties pickles its memory format as DCP's _MEM_FORMAT_ENCODING (torch's memory
# formats cannot be pickled); these are the enum's values.
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


class Record:
    """A DCP dataclass's fields as attributes: pickle's BUILD hands the dict the dataclass saved
    (or, for a slotted one, ``(dict or None, slots)``)."""

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple):
            state = {**(state[0] or {}), **state[1]}
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class TensorProperties(Record):
    """DCP's ``TensorProperties``, which pickles itself as a tuple."""

    def __setstate__(self, state) -> None:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = _MEMORY_FORMATS[encoding]


def _memory_format_encoding(value) -> int:
    """``_MEM_FORMAT_ENCODING(value)``, as its value (what TensorProperties reads back)."""
    if value not in _MEMORY_FORMATS:
        raise ValueError(f"not a DCP memory format encoding: {value!r}")
    return int(value)


# The fields with defaults of each dataclass (torch 2.13): a field at its default may be missing
# from the pickled state (MetadataIndex sets offset only when given; _StorageInfo drops Nones).
_DEFAULTS = {
    "Metadata": {"planner_data": None, "storage_data": None, "storage_meta": None, "version": None},
    "MetadataIndex": {"offset": None, "index": None},
    "StorageMeta": {"checkpoint_id": None, "save_id": None, "load_id": None, "modules": ()},
    "_StorageInfo": {"transform_descriptors": None},
}


def record_class(name: str):
    """What the unpickler builds for DCP's class ``name`` (one of the allow-list's).

    >>> p = record_class("ChunkStorageMetadata")()
    >>> p.__setstate__({"offsets": torch.Size([0]), "sizes": torch.Size([4])})
    >>> p.sizes, type(p).__name__
    (torch.Size([4]), 'ChunkStorageMetadata')
    """
    if name == "TensorProperties":
        return TensorProperties
    if name == "_MEM_FORMAT_ENCODING":
        return _memory_format_encoding
    if name not in _CLASSES:
        fields = {"__module__": __name__, "__qualname__": name, **_DEFAULTS.get(name, {})}
        _CLASSES[name] = type(name, (Record,), fields)
    return _CLASSES[name]


_CLASSES: dict[str, type] = {}
