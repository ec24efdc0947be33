"""Shard files on disk: the safetensors writer, checksums, and a verified reader that reshards on load.

A checkpoint directory holds ``manifest.json`` and one safetensors file per rank, written into a
staging directory and swapped into place by the protocol of ``_protocol.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import stat
import warnings

import numpy as np
from safetensors import SafetensorError, safe_open

from hybrid.core import FlatShardPlan, ReshardPlan, reshard, shard_flat, unpack
from hybrid.checkpoint._protocol import find, staging, write_atomically
from hybrid.checkpoint._manifest import BODY_DIGEST_KEY, MANIFEST, CheckpointError, FileEntry, Manifest, shard_file_name

# numpy has no bfloat16: such tensors are stored as their raw 16 bits, the manifest keeps the name.
_STORED_AS = {"bfloat16": np.uint16}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor of logical dtype ``dtype`` is stored (and read back) as."""
    return np.dtype(_STORED_AS.get(dtype, dtype))


_SAFETENSORS_DTYPE = {"float64": "F64", "float32": "F32", "float16": "F16", "uint16": "U16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _safetensors_chunks(tensors: dict[str, list[np.ndarray]], metadata: dict[str, str] | None = None):
    """The safetensors format (an 8-byte header length, a JSON header, the raw data), streamed from
    1-D pieces: each tensor is the concatenation of its pieces, which are never joined in memory."""
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for key, pieces in tensors.items():
        dtype = pieces[0].dtype
        assert all(p.dtype == dtype and p.ndim == 1 for p in pieces), key
        n = sum(p.shape[0] for p in pieces)
        header[key] = {"dtype": _SAFETENSORS_DTYPE[dtype.name], "shape": [n],
                       "data_offsets": [offset, offset + n * dtype.itemsize]}
        offset += n * dtype.itemsize
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    yield len(text).to_bytes(8, "little") + text
    for pieces in tensors.values():
        for p in pieces:
            if p.size:
                yield memoryview(np.ascontiguousarray(p)).cast("B")


def write_shard(path: str | os.PathLike, rank: int, world_size: int, tensors: dict[str, list[np.ndarray]], *,
                body_digest: str) -> FileEntry:
    """Write rank ``rank``'s file into the staging directory of ``path``; returns its entry.

    ``tensors[key]`` is a list of 1-D pieces whose concatenation is the saved tensor (a slice of
    a flat bucket, cut from the parameters without packing them first). ``body_digest`` is the
    :meth:`Manifest.body_digest` of the manifest that will list the file: recorded in its header,
    it binds the manifest's fields to the file's checksum.
    """
    name = shard_file_name(rank, world_size)
    chunks = _safetensors_chunks(tensors, {BODY_DIGEST_KEY: body_digest})
    size, sha = write_atomically(staging(path) / name, chunks)
    return FileEntry(name, rank, size, sha)


def _sha256_of(file: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class Checkpoint:
    """A saved checkpoint, opened for reading: its manifest, verified files and resharding reads.

    Opening reads and checks the manifest; :meth:`verify` checks every file's size and SHA-256
    (loaders call it before changing anything, so a bad file is found before half a model is
    loaded). Reads go through safetensors slices: a rank reads only the elements it needs.

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
        self._handles: dict[int, object] = {}
        self._verified: set[int] = set()
        self._warned_unbound = False

    def file(self, rank: int) -> pathlib.Path:
        return self.path / self.manifest.files[rank].name

    def verify(self, ranks=None) -> None:
        """Check the files of ``ranks`` (default all): present, of the saved size, same SHA-256."""
        entries = {f.rank: f for f in self.manifest.files}
        todo = sorted(set(range(self.manifest.world_size) if ranks is None else ranks) - self._verified)
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
            size = info.st_size
            if size != entries[rank].nbytes:
                raise CheckpointError(f"{file}: {size} bytes, the manifest says {entries[rank].nbytes}: the file is "
                                      f"truncated or was replaced")
        # hashlib releases the GIL on large blocks: the files hash in parallel.
        with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1) or 1) as pool:
            digests = dict(zip(todo, pool.map(lambda r: _sha256_of(self.path / entries[r].name), todo)))
        for rank in todo:
            file = self.path / entries[rank].name
            if digests[rank] != entries[rank].sha256:
                raise CheckpointError(f"{file}: SHA-256 differs from the manifest's: the file is corrupt")
            try:
                keys = set(self._open(rank).keys())
            except SafetensorError as e:
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
            missing = sorted(set(self.manifest.dtypes) - keys)
            if missing:
                raise CheckpointError(f"{file}: lacks tensors {missing} that the manifest lists")
            self._check_binding(rank, file)
            self._verified.add(rank)

    def _check_binding(self, rank: int, file: pathlib.Path) -> None:
        """The manifest's fields are those the file was written for (its header holds their digest)."""
        recorded = (self._open(rank).metadata() or {}).get(BODY_DIGEST_KEY)
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

    def _open(self, rank: int):
        if rank not in self._handles:
            self._handles[rank] = safe_open(str(self.file(rank)), framework="np")
        return self._handles[rank]

    def read(self, rank: int, key: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``key`` (``"params/0"``) in rank ``rank``'s file."""
        self.verify([rank])
        return self._open(rank).get_slice(key)[start:stop]

    def kinds(self) -> list[str]:
        """What is saved per bucket: ``"params"`` and the optimizer's slots."""
        return ["params", *([] if self.manifest.optimizer is None else self.manifest.optimizer.slots)]

    def reshard_to(self, dst: FlatShardPlan) -> ReshardPlan:
        return reshard(self.manifest.shards, dst)

    def slices(self, kind: str, plan: ReshardPlan, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s slices of every bucket of ``plan.dst`` for ``kind`` (stored dtypes)."""
        self.verify(plan.sources(rank))
        dtypes = [storage_dtype(b.dtype) for b in plan.dst.bucket_plan.buckets]
        return plan.gather(rank, lambda r, b, lo, hi: self.read(r, f"{kind}/{b}", lo, hi), dtypes)

    def tensors(self, kind: str) -> dict[str, np.ndarray]:
        """Every tensor of ``kind`` whole, by name, in registration order (stored dtypes)."""
        whole = shard_flat(self.manifest.plan, 1)
        flats = self.slices(kind, self.reshard_to(whole), 0)
        per_index = {}
        for b, flat in enumerate(flats):
            per_index.update(unpack(self.manifest.plan, b, flat))
        specs = self.manifest.plan.specs
        return {specs[i].name: np.array(per_index[i]) for i in range(len(specs))}

    def buffers(self) -> dict[str, np.ndarray]:
        """The replicated buffers by name, whole (stored dtypes), from rank 0's file."""
        if not self.manifest.buffers:
            return {}
        self.verify([0])
        out = {}
        for name, entry in self.manifest.buffers.items():
            n = int(np.prod(entry["shape"], dtype=np.int64))
            out[name] = self.read(0, f"buffers/{name}", 0, n).reshape(entry["shape"])
        return out

    def run_state(self) -> dict:
        """What the run saved beside the tensors (``"scheduler"``, ``"state"``), once the manifest
        is known to be the one the files were written for."""
        self.verify([0])
        return dict(self.manifest.run_state)

    def check_buffers(self, shapes: dict[str, tuple], *, what: str) -> None:
        """Raise CheckpointError unless ``shapes`` (name -> shape) are the checkpoint's buffers."""
        saved = {n: tuple(e["shape"]) for n, e in self.manifest.buffers.items()}
        missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
        if missing or extra:
            raise CheckpointError(f"{self.path}: buffers differ: {what} has {missing} which the checkpoint lacks, "
                                  f"the checkpoint has {extra} which {what} lacks")
        for name, shape in shapes.items():
            if tuple(shape) != saved[name]:
                raise CheckpointError(f"{self.path}: buffer {name!r} is {list(saved[name])} in the checkpoint and "
                                      f"{list(shape)} in {what}")

    def check_model(self, specs, *, what: str) -> None:
        """Raise CheckpointError unless ``specs`` hold the checkpoint's tensors (names, shapes, dtypes)."""
        saved = {s.name: s for s in self.manifest.plan.specs}
        mine = {s.name: s for s in specs}
        missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        if missing or extra:
            raise CheckpointError(f"{self.path}: saved from another model: {what} has {missing} which the "
                                  f"checkpoint lacks, the checkpoint has {extra} which {what} lacks")
        for name, s in mine.items():
            t = saved[name]
            if (s.shape, s.dtype) != (t.shape, t.dtype):
                raise CheckpointError(f"{self.path}: tensor {name!r} is {t.dtype}{list(t.shape)} in the "
                                      f"checkpoint and {s.dtype}{list(s.shape)} in {what}")


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
