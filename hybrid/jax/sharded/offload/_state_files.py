"""One bucket's optimizer state in a file: what :class:`hybrid.jax.OffloadedZero3` keeps between steps.

Every leaf of the bucket's state, on every device this process addresses, has an aligned region
of one memory-mapped file, unlinked as soon as it is mapped (the mapping keeps the data; a crashed
run leaves nothing on disk). A leaf put on a device from its region is, on XLA:CPU, the file's
memory itself (no copy: ``jax.device_put`` of an aligned numpy view aliases it).
"""

from __future__ import annotations

import mmap
import os
import tempfile

import jax
import numpy as np

_ALIGN = 64  # bytes: each array's region starts aligned, so XLA:CPU can use it without a copy


class _Region:
    """One array's place in a bucket's file: ``(offset, shape, dtype)`` of a device's part."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple, dtype):
        self.offset, self.shape, self.dtype = offset, shape, np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class BucketFile:
    """One bucket's state on this process: every leaf's part on every addressable device, in one
    memory-mapped file that was unlinked as soon as it was mapped."""

    def __init__(self, directory: str, leaves: list, b: int):
        self.regions: list[dict] = []  # per leaf: device id -> _Region
        offset = 0
        for leaf in leaves:
            places = {}
            for shard in leaf.addressable_shards:
                places[shard.device.id] = _Region(offset, tuple(shard.data.shape), leaf.dtype)
                offset += -(-places[shard.device.id].nbytes // _ALIGN) * _ALIGN
            self.regions.append(places)
        self.nbytes = offset
        fd, name = tempfile.mkstemp(prefix=f"zero3-state-bucket{b}-", dir=directory)
        try:
            os.unlink(name)  # the mapping keeps the data; nothing is left on disk after it
            os.ftruncate(fd, max(offset, 1))
            self._map = mmap.mmap(fd, max(offset, 1))
        finally:
            os.close(fd)

    def view(self, leaf: int, device_id: int) -> np.ndarray:
        r = self.regions[leaf][device_id]
        count = r.nbytes // r.dtype.itemsize
        return np.frombuffer(self._map, r.dtype, count, r.offset).reshape(r.shape)

    def write(self, leaves: list) -> None:
        for i, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                self.view(i, shard.device.id)[...] = np.asarray(shard.data)

    def read(self, shardings: list, shapes: list) -> list:
        """The leaves as global arrays whose device parts are (on XLA:CPU) the file's memory."""
        out = []
        for i, (sharding, shape) in enumerate(zip(shardings, shapes)):
            parts = [jax.device_put(self.view(i, d.id), d) for d in sharding.addressable_devices]
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
        return out
