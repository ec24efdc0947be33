"""Reading a torch DCP directory's ``.metadata`` without trusting it.

torch's own ``FileSystemReader.read_metadata`` unpickles the file with ``pickle.load``: a
downloaded checkpoint's metadata could run any code. Here it is unpickled by an allow-list of the
classes DCP's ``FileSystemWriter`` writes (the dataclasses of ``torch.distributed.checkpoint
.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes, the path it records); anything else is
refused, naming it; DCP's own dataclasses come back as plain records of the same fields
(``_records.py``), so reading metadata never imports ``torch.distributed.checkpoint``. Then every
file the metadata points at must be a plain name inside the directory (no ``/``, no ``..``) and a
regular file there (not a link), before anything is read.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import stat

import torch

from hybrid.checkpoint._manifest import CheckpointError
from hybrid.checkpoint.dcp._records import record_class

METADATA = ".metadata"

_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    (_DCP + "metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    (_DCP + "filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED and module.startswith(_DCP):  # plain records: no torch.distributed.checkpoint
            return record_class(name)
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.where}: holds a {module}.{name}, which a DCP FileSystemWriter's metadata does "
                              f"not: refusing to unpickle it (it could run code)")


def read_metadata(path: pathlib.Path):
    """The ``Metadata`` of the DCP checkpoint at ``path`` (a directory), unpickled by the allow-list."""
    file = path / METADATA
    try:
        info = file.lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: not a torch DCP checkpoint, or a save that never finished") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{file}: not a regular file (a symbolic link or a special file): refusing to read it")
    with open(file, "rb") as f:
        try:
            metadata = _Unpickler(f, str(file)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle: named, not a traceback
            raise CheckpointError(f"{file}: cannot be read as DCP metadata ({type(e).__name__}: {e})") from None
    if type(metadata).__name__ != "Metadata" or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file}: records no storage data (written by a storage writer other than torch's "
                              f"FileSystemWriter?)")
    return metadata


def checked_files(path: pathlib.Path, metadata) -> dict[str, int]:
    """``{relative path: size}`` of every file the metadata points at, each a plain name of a
    regular file inside ``path``, and each item's byte range inside its file; else CheckpointError
    naming the entry. Nothing outside ``path`` is opened or even looked at."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        fqn = getattr(index, "fqn", index)
        if (not isinstance(name, str) or not name or name in (".", "..") or os.path.basename(name) != name
                or "\\" in name or "\0" in name):
            raise CheckpointError(f"{path / METADATA}: entry {fqn!r} is stored in {name!r}, which is not a file of "
                                  f"the checkpoint directory: refusing to open anything outside {path}")
        if name not in sizes:
            try:
                st = (path / name).lstat()
            except FileNotFoundError:
                raise CheckpointError(f"{path / name}: missing (the metadata stores {fqn!r} in it)") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path / name}: not a regular file (a symbolic link or a special file): "
                                      f"refusing to read through it")
            sizes[name] = st.st_size
        offset, length = int(info.offset), int(info.length)
        if offset < 0 or length < 0 or offset + length > sizes[name]:
            raise CheckpointError(f"{path / name}: {sizes[name]} bytes, but the metadata stores {fqn!r} at bytes "
                                  f"{offset}..{offset + length}: the file is truncated or was replaced")
    return sizes
