"""Shard files on disk: writing a rank's file, and a verified reader that reshards on load.

A checkpoint directory holds ``manifest.json`` and one safetensors file per rank (the format of
``_shard_file.py``), written into a staging directory and swapped into place by the protocol of
``_protocol.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pathlib
import stat
import warnings

import numpy as np

from hybrid.core import BucketPlan
from hybrid.checkpoint._protocol import find, staging, write_atomically
from hybrid.checkpoint._manifest import (BODY_DIGEST_KEY, DDP_PLAN_KEY, MANIFEST, CheckpointError, FileEntry, Manifest,
                                        shard_file_name)
from hybrid.checkpoint._reader import CheckpointReader, storage_dtype
from hybrid.checkpoint._shard_file import ShardHeader, digest, encode, read_ranges

__all__ = ["Checkpoint", "read_state", "storage_dtype", "write_shard"]


def write_shard(path: str | os.PathLike, rank: int, world_size: int, tensors: dict[str, list[np.ndarray]], *,
                body_digest: str, dtypes: dict[str, str] | None = None) -> FileEntry:
    """Write rank ``rank``'s file into the staging directory of ``path``; returns its entry.

    ``tensors[key]`` is a list of 1-D pieces whose concatenation is the saved tensor (a slice of
    a flat bucket, cut from the parameters without packing them first). ``body_digest`` is the
    :meth:`Manifest.body_digest` of the manifest that will list the file: recorded in its header,
    it binds the manifest's fields to the file's checksum. ``dtypes``: each key's logical dtype
    (:meth:`Manifest.tensor_dtypes`), named in the header where safetensors has no type for it.
    """
    name = shard_file_name(rank, world_size)
    chunks, header = encode(tensors, {BODY_DIGEST_KEY: body_digest}, dtypes)
    size = write_atomically(staging(path) / name, chunks, header)
    return FileEntry(name, rank, size, header_xxh3_128=digest(header()))


def _sha256_of(file: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _open_regular(file: pathlib.Path) -> int:
    try:
        # O_NOFOLLOW: a file swapped for a link after verify() is refused, not read through.
        return os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be opened as a regular file ({e})") from None


class Checkpoint(CheckpointReader):
    """A hybrid checkpoint, opened for reading: its manifest, verified files and resharding reads
(the reads every loader makes are :class:`~hybrid.checkpoint._reader.CheckpointReader`'s).

    Opening reads and checks the manifest. :meth:`verify` checks every file (present, a regular
    file of the saved size, its header's checksum, the tensors and the manifest body it was
    written for); loaders call it before changing anything. Reads check the data they read: a
    format-3 file records a checksum per MiB of data, so a rank reads and checks only the chunks
    holding the elements it needs (formats 1 and 2: :meth:`verify` hashes each whole file first).

    >>> import numpy as np, tempfile, os
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save_arrays(d, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, world_size=2, step=7)
    >>> ckpt = Checkpoint(d)
    >>> ckpt.manifest.world_size, ckpt.manifest.step, ckpt.tensors("params")["w"].tolist()
    (2, 7, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """

    def __init__(self, path: str | os.PathLike):
        path = find(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no checkpoint directory there")
        manifest_file = path / MANIFEST
        if not manifest_file.exists():
            raise CheckpointError(f"{manifest_file} is missing: not a checkpoint, or a save that never finished")
        self.path = path
        self.manifest = Manifest.loads(manifest_file.read_text(), where=str(manifest_file))
        self._headers: dict[int, ShardHeader] = {}
        self._warned_unbound = False

    def _no_scheduler(self) -> str:
        return "saved without scheduler="

    def file(self, rank: int) -> pathlib.Path:
        return self.path / self.manifest.files[rank].name

    def verify(self, ranks=None) -> None:
        """Check the files of ``ranks`` (default all): present, regular, of the saved size, with
        the checksum the manifest holds (format 3: of the header, which holds the data's chunk
        checksums, checked as the data is read; formats 1 and 2: of the whole file), holding the
        manifest's tensors, written for this manifest's fields."""
        entries = {f.rank: f for f in self.manifest.files}
        todo = sorted(set(range(self.manifest.world_size) if ranks is None else ranks) - set(self._headers))
        for rank in todo:
            file = self.path / entries[rank].name
            try:
                info = file.lstat()
            except FileNotFoundError:
                raise CheckpointError(f"{file}: shard file of rank {rank} is missing") from None
            if not stat.S_ISREG(info.st_mode):
                # A link inside a downloaded checkpoint could point anywhere on this machine.
                raise CheckpointError(f"{file}: shard file of rank {rank} is not a regular file (a symbolic "
                                      f"link or a special file): refusing to read through it")
            self._check_size(rank, file, info.st_size)
        if self.manifest.format_version < 3 and todo:
            # hashlib releases the GIL on large blocks: the files hash in parallel.
            with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
                digests = dict(zip(todo, pool.map(lambda r: _sha256_of(self.path / entries[r].name), todo)))
            for rank in todo:
                if digests[rank] != entries[rank].sha256:
                    raise CheckpointError(f"{self.path / entries[rank].name}: SHA-256 differs from the manifest's: "
                                          f"the file is corrupt")
        for rank in todo:
            file = self.path / entries[rank].name
            fd = _open_regular(file)
            try:
                header = ShardHeader.read(fd, os.fstat(fd).st_size, where=str(file), xxh3_128=(
                    entries[rank].header_xxh3_128 if self.manifest.format_version >= 3 else None))
            finally:
                os.close(fd)
            if header.chunk_digests is None and self.manifest.format_version >= 3:
                raise CheckpointError(f"{file}: its header holds no chunk checksums, which format 3 records")
            missing = sorted(set(self.manifest.dtypes) - set(header.tensors))
            if missing:
                raise CheckpointError(f"{file}: lacks tensors {missing} that the manifest lists")
            self._check_binding(header, file)
            self._headers[rank] = header

    def _check_size(self, rank: int, file: pathlib.Path, size: int) -> None:
        if size != self.manifest.files[rank].nbytes:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {self.manifest.files[rank].nbytes}: the "
                                  f"file is truncated or was replaced")

    def _check_binding(self, header: ShardHeader, file: pathlib.Path) -> None:
        """The manifest's fields are those the file was written for (its header holds their digest)."""
        recorded = header.metadata.get(BODY_DIGEST_KEY)
        if recorded is None and self.manifest.format_version == 1:
            if not self._warned_unbound:
                warnings.warn(f"{self.path}: a format-1 checkpoint; its manifest's fields (step, optimizer "
                              f"count, hyperparameters, metadata) are not covered by the files' checksums",
                              stacklevel=4)
                self._warned_unbound = True
            return
        if recorded != self.manifest.body_digest():
            raise CheckpointError(f"{self.path / MANIFEST} was edited after the save: its fields (step, optimizer "
                                  f"count, hyperparameters, metadata, plan, dtypes...) differ from those {file.name} "
                                  f"was written for (manifest body SHA-256 {self.manifest.body_digest()[:12]}..., "
                                  f"the file records {str(recorded)[:12]}...)")

    def _read(self, requests: dict[int, list[tuple[str, int, np.ndarray]]]) -> None:
        """Fill arrays from the files: ``requests[rank]`` lists ``(key, first element, out)``, the
        elements ``[first, first + len(out))`` of tensor ``key`` into the 1-D array ``out``.
        Every chunk read is checked; files are read in parallel (preadv releases the GIL)."""
        self.verify(list(requests))

        def read_file(rank):
            header, file = self._headers[rank], self.file(rank)
            ranges = []
            for key, first, out in requests[rank]:
                entry = header.tensors.get(key)
                if entry is None or entry.dtype != out.dtype or first + len(out) > entry.numel:
                    found = "nothing" if entry is None else f"{entry.dtype}[{entry.numel}]"
                    raise CheckpointError(f"{file}: tensor {key!r} holds {found}, the plan needs {out.dtype} elements "
                                          f"{first}..{first + len(out)}")
                ranges.append((entry.start + first * out.dtype.itemsize, memoryview(out).cast("B")))
            fd = _open_regular(file)
            try:
                self._check_size(rank, file, os.fstat(fd).st_size)
                read_ranges(fd, header, ranges, where=str(file))
            finally:
                os.close(fd)

        ranks = sorted(requests)
        if len(ranks) <= 1:
            for rank in ranks:
                read_file(rank)
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(ranks), os.cpu_count() or 1)) as pool:
            list(pool.map(read_file, ranks))

    def read(self, rank: int, key: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``key`` (``"params/0"``) in rank ``rank``'s file."""
        self.verify([rank])
        entry = self._headers[rank].tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.file(rank)}: holds no tensor {key!r}")
        out = np.empty(stop - start, entry.dtype)
        self._read({rank: [(key, start, out)]})
        return out


def read_state(path: str | os.PathLike) -> dict:
    """The run state a checkpoint was saved with (``save(..., state=...)`` in either frontend):
    the user's JSON, verified like the rest of the checkpoint; ``{}`` if none was saved.

    >>> import numpy as np, tempfile, os
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save_arrays(d, {"w": np.zeros(2, np.float32)}, run_state={"state": {"epoch": 3, "seed": 7}})
    >>> read_state(d)
    {'epoch': 3, 'seed': 7}
    """
    return dict(Checkpoint(path).run_state().get("state", {}))


def torch_ready_order(path: str | os.PathLike) -> tuple[str, ...] | None:
    """torch's own gradient-ready order as the hybrid DDP that saved the checkpoint observed it (the
    members of its rebuilt bucket plan, in bucket order), or None where none was recorded (saved
    before the DDP's first rebuild, by ZeRO3, by JAX or by an older hybrid).

    A JAX run that resumes it through a mapping plans as that DDP did with
    ``pairing.with_torch_ready(torch_ready_order(path))``: the torch half's truth, with no torch
    module at hand (docs/moving-runs.md).

    >>> import numpy as np, tempfile, os
    >>> from hybrid.checkpoint import save_arrays
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save_arrays(d, {"w": np.zeros(2, np.float32)})
    >>> torch_ready_order(d) is None  # no DDP saved it
    True
    """
    saved = Checkpoint(path).run_state().get(DDP_PLAN_KEY)
    if saved is None:
        return None
    plan = BucketPlan.from_json(saved["plan"])
    return tuple(plan.specs[m].name for bucket in plan.buckets for m in bucket.members)
