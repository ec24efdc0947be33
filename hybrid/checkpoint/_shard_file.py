"""One rank's shard file: safetensors, with a checksum per chunk of its data (format 3).

The file is a plain safetensors file (an 8-byte little-endian header length, a JSON header, the
raw data) that any safetensors reader opens. Its header's ``__metadata__`` holds the digest of the
manifest body it was written for and the XXH3-128 of every ``CHUNK_BYTES`` of the data region; the
manifest holds the XXH3-128 of the header. A reader checks the header against the manifest (a few
KiB), then every chunk it reads against the header: a rank verifies what it reads, as it reads
it, and nothing it does not need.

Writing is one pass: each chunk is hashed from the caller's memory right before it is written (no
packed copy of the file). The header goes first with placeholder digests of the same length and
is written again over them once the data is written, before the fsync.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from hybrid.checkpoint._dtypes import DTYPES_KEY, entry_storage, safetensors_entry
from hybrid.checkpoint._manifest import CheckpointError

CHUNK_BYTES = 1 << 20
CHUNK_BYTES_KEY = "hybrid.chunk_bytes"
CHUNK_DIGESTS_KEY = "hybrid.chunk_xxh3_128"
_DIGEST_HEX = 32
# safetensors refuses larger headers too.
_MAX_HEADER_BYTES = 100_000_000



def digest(data) -> str:
    """The XXH3-128 of ``data`` (bytes-like), as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def encode(tensors: dict[str, list[np.ndarray]], metadata: dict[str, str], dtypes: dict[str, str] | None = None
           ) -> tuple[Iterator[memoryview | bytes], Callable[[], bytes]]:
    """A shard file's bytes, streamed from 1-D pieces: ``(chunks, header)``.

    ``tensors[key]`` is the concatenation of its pieces (stored dtypes, ``_dtypes.py``), which
    are never joined in memory; ``dtypes[key]``, where given, its logical dtype (bfloat16 stored
    as uint16, ...), recorded in the header where its safetensors type is not it (complex
    tensors are written as their real view, ``[n, 2]``).
    ``chunks`` yields the header (placeholder digests) and then the data, hashing every
    ``CHUNK_BYTES`` as it goes; once it is exhausted, ``header()`` is the final header, of the
    same length, to write over the first bytes.

    >>> chunks, header = encode({"w": [np.arange(3, dtype=np.float32)]}, {"k": "v"})
    >>> data = b"".join(chunks)
    >>> len(header()) == len(data) - 12 and header() != data[:len(header())]
    True
    """
    entries, offset, true_dtypes = {}, 0, {}
    for key, pieces in tensors.items():
        dtype = pieces[0].dtype
        assert all(p.dtype == dtype and p.ndim == 1 for p in pieces), key
        n = sum(p.shape[0] for p in pieces)
        kind, shape, true_dtype = safetensors_entry(dtype, n, (dtypes or {}).get(key))
        if true_dtype is not None:
            true_dtypes[key] = true_dtype
        entries[key] = {"dtype": kind, "shape": shape, "data_offsets": [offset, offset + n * dtype.itemsize]}
        offset += n * dtype.itemsize
    num_chunks = -(-offset // CHUNK_BYTES)
    if true_dtypes:
        metadata = {**metadata, DTYPES_KEY: json.dumps(true_dtypes, separators=(",", ":"))}

    def header_of(digests: list[str]) -> bytes:
        meta = {**metadata, CHUNK_BYTES_KEY: str(CHUNK_BYTES), CHUNK_DIGESTS_KEY: "".join(digests)}
        text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        return len(text).to_bytes(8, "little") + text

    placeholder = header_of(["0" * _DIGEST_HEX] * num_chunks)
    digests: list[str] = []

    def chunks():
        yield placeholder
        hasher, filled = xxhash.xxh3_128(), 0
        for pieces in tensors.values():
            for p in pieces:
                data = memoryview(np.ascontiguousarray(p)).cast("B")
                pos = 0
                while pos < len(data):
                    # At most one chunk at a time: hashed, then written while it is still in cache.
                    segment = data[pos:pos + CHUNK_BYTES - filled]
                    hasher.update(segment)
                    filled += len(segment)
                    pos += len(segment)
                    if filled == CHUNK_BYTES:
                        digests.append(hasher.hexdigest())
                        hasher.reset()
                        filled = 0
                    yield segment
        if filled:
            digests.append(hasher.hexdigest())

    def header() -> bytes:
        assert len(digests) == num_chunks, "header() before the data was written"
        final = header_of(digests)
        assert len(final) == len(placeholder)
        return final

    return chunks(), header


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A tensor of a shard file: its dtype, shape and bytes ``[start, stop)`` of the data region."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return (self.stop - self.start) // self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """A shard file's parsed header. ``data_start``: where the data region begins in the file;
    ``chunk_digests``: one per ``chunk_bytes`` of the data (None before format 3)."""

    data_start: int
    data_bytes: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    chunk_bytes: int | None
    chunk_digests: tuple[str, ...] | None

    @classmethod
    def read(cls, fd: int, file_size: int, *, where: str, xxh3_128: str | None = None) -> "ShardHeader":
        """The header of the open file ``fd``, first checked against ``xxh3_128`` (its digest in
        the manifest) where given."""
        def bad(why):
            return CheckpointError(f"{where}: not a readable safetensors file ({why})")
        n = int.from_bytes(_pread(fd, 8, 0, where), "little") if file_size >= 8 else -1
        if not 0 <= n <= min(_MAX_HEADER_BYTES, file_size - 8):
            raise bad(f"a header of {n} bytes in a file of {file_size}")
        raw = _pread(fd, 8 + n, 0, where)
        if xxh3_128 is not None and digest(raw) != xxh3_128:
            raise CheckpointError(f"{where}: its header differs from the manifest's checksum of it: the file is corrupt "
                                  f"or was replaced")
        try:
            d = json.loads(raw[8:])
            metadata = d.pop("__metadata__", None) or {}
            data_bytes = file_size - 8 - n
            true_dtypes = json.loads(metadata.get(DTYPES_KEY, "{}"))
            tensors = {key: cls._entry(e, data_bytes, true_dtypes.get(key)) for key, e in d.items()}
            chunk_bytes = int(metadata[CHUNK_BYTES_KEY]) if CHUNK_BYTES_KEY in metadata else None
            digests = None
            if chunk_bytes is not None:
                text = metadata[CHUNK_DIGESTS_KEY]
                digests = tuple(text[i:i + _DIGEST_HEX] for i in range(0, len(text), _DIGEST_HEX))
                if chunk_bytes <= 0 or len(digests) != -(-data_bytes // chunk_bytes):
                    raise ValueError(f"{len(digests)} chunk digests for {data_bytes} bytes of data")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        return cls(8 + n, data_bytes, tensors, metadata, chunk_bytes, digests)

    @staticmethod
    def _entry(e: dict, data_bytes: int, true_dtype: str | None) -> TensorEntry:
        """A tensor's entry; ``dtype`` is its storage dtype (a complex tensor's real view
        ``[n, 2]`` is ``n`` complex elements), ``shape`` as the header writes it."""
        shape = tuple(int(x) for x in e["shape"])
        dtype = entry_storage(e["dtype"], shape, true_dtype)
        start, stop = (int(x) for x in e["data_offsets"])
        component = np.dtype(entry_storage(e["dtype"], shape, None)).itemsize
        if not 0 <= start <= stop <= data_bytes or stop - start != int(np.prod(shape)) * component:
            raise ValueError(f"offsets {[start, stop]} of a {e['dtype']}{list(shape)} tensor in {data_bytes} bytes")
        return TensorEntry(dtype, shape, start, stop)


def _pread(fd: int, n: int, offset: int, where: str) -> bytes:
    out = bytearray(n)
    _pread_into(fd, [memoryview(out)], offset, where)
    return bytes(out)


def _pread_into(fd: int, buffers: list[memoryview], offset: int, where: str) -> None:
    """Fill ``buffers`` (consecutive in the file) from ``offset``, in as few system calls as may be."""
    buffers = [b for b in buffers if len(b)]
    while buffers:
        n = os.preadv(fd, buffers, offset)
        if n == 0:
            raise CheckpointError(f"{where}: ends {sum(map(len, buffers))} bytes early: the file is truncated")
        offset += n
        while buffers and n >= len(buffers[0]):
            n -= len(buffers.pop(0))
        if buffers:
            buffers[0] = buffers[0][n:]


def read_ranges(fd: int, header: ShardHeader, requests: list[tuple[int, memoryview]], *, where: str) -> None:
    """Read byte ranges of the data region (``(start, out)``: ``len(out)`` bytes from ``start``,
    non-overlapping) into memory, then check every chunk they touch against the header.

    The bytes checked are the bytes read, in the caller's memory (no second read that could differ).
    A chunk's bytes that no request covers are read aside to complete its checksum. Raises
    CheckpointError naming the corrupt bytes.
    """
    requests = sorted(((s, out) for s, out in requests if len(out)), key=lambda r: r[0])
    assert all(a + len(out) <= b for (a, out), (b, _) in zip(requests, requests[1:])), "overlapping reads"
    i = 0
    while i < len(requests):  # ranges that follow each other in the file: one preadv
        j, end = i + 1, requests[i][0] + len(requests[i][1])
        while j < len(requests) and requests[j][0] == end and j - i < 512:
            end += len(requests[j][1])
            j += 1
        _pread_into(fd, [out for _, out in requests[i:j]], header.data_start + requests[i][0], where)
        i = j
    if header.chunk_digests is None:
        return  # formats 1 and 2: the whole file's SHA-256 was checked before
    size = header.chunk_bytes
    touched = sorted({j for s, out in requests for j in range(s // size, (s + len(out) - 1) // size + 1)})
    first = 0
    for j in touched:
        lo, hi = j * size, min((j + 1) * size, header.data_bytes)
        while requests[first][0] + len(requests[first][1]) <= lo:
            first += 1
        hasher, pos, k = xxhash.xxh3_128(), lo, first
        while pos < hi:
            start, out = requests[k] if k < len(requests) else (hi, None)
            if start <= pos:
                end = min(start + len(out), hi)
                hasher.update(out[pos - start:end - start])
                k += end == start + len(out)
            else:
                end = min(start, hi)
                hasher.update(_pread(fd, end - pos, header.data_start + pos, where))
            pos = end
        if hasher.hexdigest() != header.chunk_digests[j]:
            raise CheckpointError(f"{where}: bytes {lo}..{hi} of its data differ from their checksum (chunk {j} of "
                                  f"{len(header.chunk_digests)}): the file is corrupt")
