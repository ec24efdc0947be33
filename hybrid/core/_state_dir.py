"""Where offloaded optimizer state may live: a directory checked once, for both frontends.

``hybrid.torch.ZeRO3Optimizer(offload_dir=)`` and ``hybrid.jax.OffloadedZero3`` keep optimizer
state in files under a directory the user gives. Both refuse a directory that is missing or not
writable (naming it), and warn when it is on a file system whose files live in memory, where
"offloading" frees nothing. Standard library only: no framework is imported here.
"""

from __future__ import annotations

import os
import warnings

# File systems whose files live in memory: state kept there frees none of it.
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


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


def offload_directory(directory, *, argument: str = "offload_dir", stacklevel: int = 3) -> str:
    """``directory`` as a str once it is a writable directory; a ValueError naming it otherwise,
    and a warning where its file system keeps files in memory.

    >>> offload_directory("/no/such/dir")
    Traceback (most recent call last):
    ...
    ValueError: offload_dir='/no/such/dir' is not a directory
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{argument}={directory!r} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{argument}={directory!r} is not writable by this process")
    kind = filesystem_type(directory)
    if kind in IN_MEMORY_FILESYSTEMS:
        warnings.warn(f"{argument}={directory!r} is on {kind}, whose files live in memory: the optimizer state "
                      f"kept there frees no memory; give a directory on a disk", stacklevel=stacklevel + 1)
    return directory
