"""The save protocol: at every instant, a complete checkpoint is readable at PATH or found there.

A save of PATH (after resolving symbolic links: a save through ``latest -> step-01000`` writes
``step-01000``, and the link keeps pointing at a complete checkpoint) uses two hidden siblings,
``.NAME.saving`` (the save being written) and ``.NAME.previous`` (the checkpoint being replaced).
Only complete directories are ever renamed to PATH, and a directory is only ever renamed to
``.NAME.previous`` from PATH, so both hold complete checkpoints whenever they exist whole. The
operations, and what a crash right before each one leaves:

``begin_save``
  1. if PATH is missing and ``.previous`` exists (a save crashed between the two renames of its
     swap): rename ``.previous`` back to PATH. Before: the reader finds ``.previous``.
  2. if PATH exists: remove ``.previous`` (file by file). PATH is complete; a crash midway leaves
     a partial ``.previous`` beside it, which the reader ignores (it reads PATH) and step 2 of the
     next save removes.
  3. remove ``.saving`` (an earlier save's leftovers; never committed) and make it anew.

writing (every rank)
  4. each file is written to ``FILE.part``, fsynced, renamed to ``FILE``, all inside ``.saving``.

``commit_save``
  5. write the manifest inside ``.saving`` (``.part``, fsync, rename), fsync the directory.
  6. if PATH exists: remove ``.previous`` (leftovers of a crash in step 9), rename PATH to
     ``.previous``. A crash between this rename and step 7: PATH is missing, the reader finds the
     old checkpoint in ``.previous``, the next save puts it back (step 1).
  7. rename ``.saving`` to PATH: **the commit point**. From here on PATH holds the new checkpoint.
  8. fsync PATH's parent directory.
  9. remove ``.previous``: each rank its own old shard files, rank 0 the rest, and whichever
     rank finishes last the emptied directory. No barrier: a rank returns once its own part is
     gone (a rank that starts the next save early may remove a straggler's files for it).

``Checkpoint(PATH)`` reads PATH if it holds a manifest, else ``.previous`` (with a warning).
The crash-injection test (tests/checkpoint/test_protocol.py) stops a save before each of these
file-system operations in turn, and before each pair of operations across two saves, and checks
that the newest committed checkpoint loads. Concurrent readers and writers of one PATH are not
coordinated (one saver at a time, as in any training run).
"""

from __future__ import annotations

import errno
import os
import pathlib
import warnings

from hybrid.checkpoint._manifest import MANIFEST, Manifest, shard_file_rank


class FileSystem:
    """Every file-system operation a save makes, in one place (tests stop a save at any of them).

    ``before(op, path)`` runs first in every operation: the crash-injection test overrides it.
    """

    def before(self, op: str, path: pathlib.Path) -> None:
        del op, path

    def mkdir(self, path: pathlib.Path) -> None:
        self.before("mkdir", path)
        path.mkdir(parents=True)

    def write(self, part: pathlib.Path, chunks, header=None) -> int:
        """Write ``chunks`` (bytes-like) to ``part``, then ``header()`` over its first bytes if
        given, and fsync it; returns the size."""
        size = 0
        self.before("create", part)
        with open(part, "wb") as f:
            for i, chunk in enumerate(chunks):
                if i == 1:  # a crash here leaves a partly written file
                    self.before("write", part)
                size += f.write(chunk)
            f.flush()
            if header is not None:
                data, pos = memoryview(header()), 0
                while pos < len(data):
                    pos += os.pwrite(f.fileno(), data[pos:], pos)
            os.fsync(f.fileno())
        return size

    def replace(self, src: pathlib.Path, dst: pathlib.Path) -> None:
        self.before("rename", src)
        os.replace(src, dst)

    def fsync_dir(self, path: pathlib.Path) -> None:
        self.before("fsync", path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: pathlib.Path) -> None:
        """Remove a file; one another rank removed first is not an error (step 9 has no barrier)."""
        self.before("unlink", path)
        path.unlink(missing_ok=True)

    def rmdir(self, path: pathlib.Path) -> bool:
        """Remove an empty directory; False if it is not empty yet or already gone (another rank
        still removing its files, or done first)."""
        self.before("rmdir", path)
        try:
            path.rmdir()
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True

    def remove_tree(self, path: pathlib.Path) -> None:
        """Remove ``path`` and what it holds, one file at a time (a crash may stop it midway).
        Entries another process removes meanwhile are skipped."""
        if not path.exists() and not path.is_symlink():
            return
        if path.is_symlink() or not path.is_dir():
            self.unlink(path)
            return
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                self.unlink(pathlib.Path(root, name))
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    self.rmdir(pathlib.Path(root, name))
        self.rmdir(path)  # a straggler's step 9 may have removed it once it was empty


fs = FileSystem()


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """PATH with symbolic links followed (a dangling link: where it points), so a save through a
    link writes the directory it points at and leaves the link alone."""
    return pathlib.Path(os.path.realpath(path))


def staging(path: str | os.PathLike) -> pathlib.Path:
    """The hidden directory a save of ``path`` writes into."""
    path = resolve(path)
    return path.parent / f".{path.name}.saving"


def previous(path: str | os.PathLike) -> pathlib.Path:
    """Where the checkpoint a save replaces waits until the new one is in place."""
    path = resolve(path)
    return path.parent / f".{path.name}.previous"


def write_atomically(target: pathlib.Path, chunks, header=None) -> int:
    """Write ``chunks`` (and ``header()`` over the first bytes) to ``target.part``, fsync, rename;
    returns the size."""
    part = target.with_name(target.name + ".part")
    size = fs.write(part, chunks, header)
    fs.replace(part, target)
    return size


def begin_save(path: str | os.PathLike) -> pathlib.Path:
    """Steps 1-3: repair what an interrupted save left (never losing the newest committed
    checkpoint) and make the staging directory (one process)."""
    path, stage, prev = resolve(path), staging(path), previous(path)
    if not path.exists() and prev.exists():
        fs.replace(prev, path)
    if path.exists():
        fs.remove_tree(prev)
    fs.remove_tree(stage)
    fs.mkdir(stage)
    return stage


def commit_save(path: str | os.PathLike, manifest: Manifest, *, remove_previous: bool = True) -> None:
    """Steps 5-9: write the manifest last, then swap the staging directory into ``path`` (one
    process). ``remove_previous=False`` leaves step 9 to the caller (:func:`remove_previous_part`
    on every rank)."""
    path, stage, prev = resolve(path), staging(path), previous(path)
    write_atomically(stage / MANIFEST, [manifest.dumps().encode()])
    fs.fsync_dir(stage)
    if path.exists():
        # Two renames, not one: a directory cannot replace a non-empty one. In between, a reader
        # finds the checkpoint being replaced under .NAME.previous.
        fs.remove_tree(prev)
        fs.replace(path, prev)
    fs.replace(stage, path)
    fs.fsync_dir(path.parent)
    if remove_previous:
        fs.remove_tree(prev)


def abandon_save(path: str | os.PathLike, *, own_rank: int | None = None) -> None:
    """After a save that failed before its commit: remove what it staged, so no ``.NAME.saving``
    is left behind. By default (the process that began the save, or the only one) the whole
    staging directory; with ``own_rank`` only that rank's shard file (a process that is not the
    one that began the save removes what it wrote; a peer may still be writing its own). PATH and
    ``.previous`` are never touched, and after the commit point there is no staging directory
    left: calling it then changes nothing."""
    stage = staging(path)
    try:
        if own_rank is None:
            fs.remove_tree(stage)
            return
        for name in os.listdir(stage):
            if shard_file_rank(name.removesuffix(".part")) == own_rank:
                fs.unlink(stage / name)
    except FileNotFoundError:  # never made, already committed, or removed by the process that began it
        pass


def remove_previous_part(path: str | os.PathLike, rank: int, world_size: int, *, map=map) -> None:
    """Step 9 shared out, after the commit: rank ``rank`` of ``world_size`` removes the replaced
    checkpoint's shard files it owns (ranks ``rank``, ``rank + world_size``, ...), rank 0 also
    the manifest and anything else, and each then tries to remove the directory: the last to
    finish succeeds. Freeing the old files costs each rank what overwriting its own would, and no
    rank waits for another's; ``map`` may run the removals in threads."""
    prev = previous(path)
    try:
        if prev.is_symlink() or not prev.is_dir():
            return
        names = sorted(os.listdir(prev))
    except FileNotFoundError:  # another rank removed it first
        return
    # A shard file is its rank's (modulo world_size); the manifest and anything else, rank 0's.
    mine = [prev / name for name in names if (shard_file_rank(name) or 0) % world_size == rank]
    list(map(fs.remove_tree, mine))
    fs.rmdir(prev)


def find(path: str | os.PathLike) -> pathlib.Path:
    """The directory a reader of ``path`` should open: PATH (links followed) if it holds a
    manifest, else the checkpoint an interrupted save left in ``.NAME.previous``."""
    target, prev = resolve(path), previous(path)
    if not (target / MANIFEST).exists() and (prev / MANIFEST).exists():
        warnings.warn(f"{path}: a save was interrupted while swapping directories; reading the "
                      f"previous checkpoint from {prev}", stacklevel=3)
        return prev
    return target
