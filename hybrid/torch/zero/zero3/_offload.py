"""Optimizer state kept in files instead of the process's memory: ``ZeRO3Optimizer(offload_dir=)``.

Each state tensor of a master segment (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum
buffer) is moved, after the step that made it, into a file of its own under the directory,
memory-mapped shared (``torch.from_file``) and unlinked at once: the tensor is the only
reference, so its disk space goes with it and a crashed run leaves no files behind. The
optimizer then reads and updates the state where it lives, in place, as DeepSpeed's ZeRO-Infinity
keeps state on NVMe: none of it is held by the allocator, so a rank's allocator-counted memory is
its parameter slices, one bucket's working set and the activations. The kernel's page cache may
keep the pages in RAM while memory is free, and writes them back and evicts them when it is not.
"""

from __future__ import annotations

import os
import tempfile
import warnings
import weakref
from typing import Any

import torch

# File systems whose files live in memory: state kept there frees none of it.
_IN_MEMORY = ("tmpfs", "ramfs")


def filesystem_type(path: str) -> str | None:
    """The type of the file system ``path`` is on, from ``/proc/mounts`` (None where there is none:
    not Linux). The mount point that is the longest prefix of the path's real path wins.

    >>> filesystem_type("/proc") in ("proc", None)
    True
    """
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for point, kind in mounts:
        point = point.replace("\\040", " ")  # /proc/mounts escapes spaces
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, kind)
    return best[1] if best else None


class StateFiles:
    """The directory an optimizer's state tensors are kept in, and the tensors it made.

    >>> import tempfile
    >>> files = StateFiles(tempfile.mkdtemp(), torch.device("cpu"))
    >>> state = {"step": torch.tensor(1.0), "exp_avg": torch.ones(3)}
    >>> files.settle(state)
    >>> files.holds(state["exp_avg"]), files.holds(state["step"]), files.held_bytes()
    (True, False, 12)
    """

    def __init__(self, directory: str | os.PathLike, device: torch.device):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ValueError(f"offload_dir={directory!r} is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"offload_dir={directory!r} is not writable by this process")
        if device.type != "cpu":
            # A device's state would go through host buffers bucket by bucket; only the CPU path
            # (state stepped in place where it lives) exists.
            raise ValueError(f"offload_dir: the parameters are on {device}; offloading the optimizer state is "
                             f"built for CPU parameters only")
        kind = filesystem_type(directory)
        if kind in _IN_MEMORY:
            warnings.warn(f"offload_dir={directory!r} is on {kind}, whose files live in memory: the optimizer state "
                          f"kept there frees no memory; give a directory on a disk", stacklevel=3)
        self.directory = directory
        self._made: dict[int, weakref.ref] = {}  # id -> the tensor, for holds() (== on tensors is elementwise)

    def holds(self, t: torch.Tensor) -> bool:
        ref = self._made.get(id(t))
        return ref is not None and ref() is t

    def keep(self, value: torch.Tensor) -> torch.Tensor:
        """A file-backed copy of ``value`` (1-d, CPU)."""
        fd, name = tempfile.mkstemp(prefix="state-", dir=self.directory)
        os.close(fd)
        try:
            out = torch.from_file(name, shared=True, size=value.numel(), dtype=value.dtype)
        finally:
            os.unlink(name)  # the mapping keeps the data; nothing is left on disk after it
        out.copy_(value.reshape(-1))
        made = out.view(value.shape)
        key = id(made)
        self._made[key] = weakref.ref(made, lambda _, key=key: self._made.pop(key, None))
        return made

    def settle(self, state: dict[str, Any]) -> None:
        """Move ``state``'s tensors (all but scalars such as Adam's ``step``) into files, in place."""
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and not self.holds(v):
                state[k] = self.keep(v)

    def held_bytes(self) -> int:
        """Bytes of state kept in files (alive tensors made here)."""
        return sum(t.numel() * t.element_size() for t in (r() for r in list(self._made.values())) if t is not None)
