"""Collectives that fail loudly: a peer that died or stalled past the process group's timeout
becomes a RuntimeError saying which collective of which component gave up, instead of gloo's or
NCCL's bare text (or a hang). Shared by DDP and the ZeRO classes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (FutureWarning) in favour of
# the *_single spellings; older torch has only the former. Users must not see warnings from our calls.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_WHY = "failed (a peer died or stalled past the process group's timeout)"


# torch's own check under TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper): every collective's
# fingerprint compared over the ranks before it runs.
_TORCH_MISMATCH = "Detected mismatch between collectives"
_MISMATCH = "failed: torch's collective check (TORCH_DISTRIBUTED_DEBUG=DETAIL) found the ranks in different collectives"
_DETAIL_HINT = ("if a rank may be in a collective of its own instead (a dist.barrier() or a save on some ranks only), "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch name both collectives at once instead of waiting")


def collective_failed(what: str, error: BaseException) -> RuntimeError:
    """``error`` (a collective's) as a RuntimeError that names the collective, and says why it may
    have failed: a peer that died or stalled (with, for a wait that ran out, how to have torch
    name a peer that is in another collective), or torch's own mismatch check.

    >>> str(collective_failed("DistributedDataParallel: the all-reduce of gradient bucket 0",
    ...                       RuntimeError("Connection closed by peer")))[:60]
    'DistributedDataParallel: the all-reduce of gradient bucket 0'
    >>> "TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch name" in str(collective_failed("x", RuntimeError("timed out")))
    True
    """
    text = str(error)
    if _TORCH_MISMATCH in text:
        return RuntimeError(f"{what} {_MISMATCH}: a rank is in a collective of its own (a dist.barrier() or a "
                            f"save on some ranks only, say) while the others are here; every rank must reach the "
                            f"same collectives in the same order: {error}")
    hint = f" ({_DETAIL_HINT})" if not peer_gone(error) else ""
    return RuntimeError(f"{what} {_WHY}{hint}: {error}")


# How gloo and NCCL word a peer that went away or a wait that ran out (their errors reach Python as
# plain RuntimeErrors when they come through a Future).
_BACKEND_MARKS = ("gloo", "nccl", "connection reset", "connection closed", "timed out", "timeout", "pair closure")


# How gloo words a peer whose process is gone (its socket closed), as opposed to one that is late.
_GONE_MARKS = ("connection reset", "connection closed", "connection refused", "broken pipe")


def peer_gone(error: BaseException) -> bool:
    """Whether a failed collective's ``error`` says a peer's process went away (its connection
    closed), rather than that a wait ran out.

    >>> peer_gone(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    True
    >>> peer_gone(RuntimeError("[gloo/transport/tcp/pair.cc:446] Timed out waiting 5000ms for recv"))
    False
    """
    text = str(error).lower()
    return any(mark in text for mark in _GONE_MARKS)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is the backend reporting a failed collective (a dead or stalled peer),
    rather than, say, a bug in a comm hook's own code, which must surface as it is.

    >>> is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer"))
    True
    >>> is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    True
    >>> is_collective_failure(RuntimeError("Cannot access data pointer of Tensor"))
    False
    """
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error).lower()
    return any(mark in text for mark in _BACKEND_MARKS)


@contextlib.contextmanager
def naming(what: str, *, user_code: bool = False):
    """Run a collective (or a wait on one); its failure raises :func:`collective_failed` for
    ``what``. With ``user_code`` (a comm hook's Future, whose callbacks are the user's), only what
    :func:`is_collective_failure` recognises as the backend's is renamed; a bug in the user's code
    passes through untouched."""
    try:
        yield
    except RuntimeError as e:  # gloo/NCCL errors and DistBackendError (a subclass)
        if _WHY in str(e) or _MISMATCH in str(e) or (user_code and not is_collective_failure(e)):
            raise  # already named (a comm hook's own), or the user's own error: surface it as it is
        raise collective_failed(what, e) from e


def wait_all(works: list[tuple[str, Any]]) -> None:
    """Wait for ``(what, work)`` pairs; a failed one raises :func:`collective_failed`."""
    for what, work in works:
        with naming(what):
            work.wait()
