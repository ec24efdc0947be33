"""Collectives that fail loudly: a peer that died or stalled past the process group's timeout
becomes a RuntimeError saying which collective of which component gave up, instead of gloo's or
NCCL's bare text (or a hang). Shared by DDP and the ZeRO classes."""

from __future__ import annotations

import contextlib
from typing import Any


_WHY = "failed (a peer died or stalled past the process group's timeout)"


def collective_failed(what: str, error: BaseException) -> RuntimeError:
    """``error`` (a collective's) as a RuntimeError that names the collective.

    >>> str(collective_failed("DistributedDataParallel: the all-reduce of gradient bucket 0",
    ...                       RuntimeError("Connection closed by peer")))[:60]
    'DistributedDataParallel: the all-reduce of gradient bucket 0'
    """
    return RuntimeError(f"{what} {_WHY}: {error}")


@contextlib.contextmanager
def naming(what: str):
    """Run a collective (or a wait on one); a failure raises :func:`collective_failed` for ``what``."""
    try:
        yield
    except RuntimeError as e:  # gloo/NCCL errors and DistBackendError (a subclass)
        if _WHY in str(e):
            raise  # already names its collective (a comm hook's own, say): the innermost is the one
        raise collective_failed(what, e) from e


def wait_all(works: list[tuple[str, Any]]) -> None:
    """Wait for ``(what, work)`` pairs; a failed one raises :func:`collective_failed`."""
    for what, work in works:
        with naming(what):
            work.wait()
