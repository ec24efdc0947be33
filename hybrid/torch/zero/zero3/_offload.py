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
import weakref
from typing import Any

import torch

from hybrid.core._state_dir import filesystem_type, offload_directory

__all__ = ["StateFiles", "filesystem_type"]


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
        directory = offload_directory(directory, stacklevel=3)
        if device.type != "cpu":
            # A device's state would go through host buffers bucket by bucket; only the CPU path
            # (state stepped in place where it lives) exists.
            raise ValueError(f"offload_dir: the parameters are on {device}; offloading the optimizer state is "
                             f"built for CPU parameters only")
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
