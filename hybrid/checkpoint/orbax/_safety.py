"""Checks that reading an orbax checkpoint opens nothing outside its directory, before orbax reads it.

An orbax checkpoint is a directory tree: metadata files, and the arrays in an OCDBT database
(tensorstore's B+tree: ``manifest.ocdbt`` and data files, also per process under
``ocdbt.process_N/``) or, without OCDBT, a directory per array named by its key path. Three
ways out of the directory are closed here:

- a symbolic link (or a special file) anywhere in the tree: refused, nothing is followed;
- a key path that would name a directory outside (``..``, ``/``): refused;
- an OCDBT database whose manifest or B+tree nodes point at data files by a path leaving its
  directory (the format allows any relative path): every location in every version and node,
  read with tensorstore's own ``ocdbt.dump``, must stay inside.
"""

from __future__ import annotations

import os
import pathlib
import re
import stat

from hybrid.checkpoint._manifest import CheckpointError

_LOCATION = re.compile(r"^(btreenode|versionnode|value)::(.*):(\d+):(\d+)$")


def check_tree(root: pathlib.Path) -> None:
    """Every entry under ``root`` is a regular file or a directory (no links, no devices)."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(f"{os.path.join(dirpath, name)}: a symbolic link or special file inside the "
                                      f"orbax checkpoint {root}: refusing to read through it")


def check_key(parts: tuple[str, ...], *, where: pathlib.Path) -> None:
    """A key path whose parts would leave the directory when orbax names files by it."""
    for part in parts:
        if part in ("", ".", "..") or "/" in part or "\\" in part or "\0" in part:
            raise CheckpointError(f"{where}: holds a tree key {'.'.join(parts)!r} whose part {part!r} could name a file "
                                  f"outside the checkpoint: refusing to read it")


def _inside(base: pathlib.Path, relative: str, root: pathlib.Path, *, where: str) -> None:
    parts = pathlib.PurePosixPath(relative).parts
    if not relative or relative.startswith("/") or ".." in parts or "\\" in relative:
        raise CheckpointError(f"{where}: points at data file {relative!r}, outside the checkpoint {root}: refusing "
                              f"to read it")
    target = base / relative
    try:
        mode = target.lstat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{where}: points at data file {target}, which is missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{target}: not a regular file: refusing to read through it")


def check_ocdbt(root: pathlib.Path) -> None:
    """Every OCDBT database under ``root``: all its locations stay inside ``root``."""
    import tensorstore as ts

    for manifest in sorted(root.rglob("manifest.ocdbt")):
        base = manifest.parent
        where = str(manifest)
        try:
            kv = ts.KvStore.open(f"file://{base}/").result()
            todo, seen = [ts.ocdbt.dump(kv).result()], set()
        except Exception as e:  # noqa: BLE001 - named
            raise CheckpointError(f"{where}: cannot be read as an OCDBT manifest ({type(e).__name__}: {e})") from None
        while todo:
            for location in _locations(todo.pop()):
                kind, relative = _LOCATION.match(location).group(1, 2)
                _inside(base, relative, root, where=where)
                if kind != "value" and location not in seen:
                    seen.add(location)
                    try:
                        todo.append(ts.ocdbt.dump(kv, location).result())
                    except Exception as e:  # noqa: BLE001 - named
                        raise CheckpointError(f"{where}: node {location} cannot be read ({type(e).__name__}: "
                                              f"{e})") from None


def _locations(node) -> list[str]:
    """Every location string in a dumped OCDBT manifest or node (``kind::path:offset:length``)."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in _locations(v)]
    if isinstance(node, list):
        return [x for v in node for x in _locations(v)]
    return [node] if isinstance(node, str) and _LOCATION.match(node) else []
