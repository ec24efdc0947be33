"""A gloo world of fresh processes on this machine: the torch side of the demo and of ``hybrid.parity``.

Each rank is a new interpreter, ``python -m hybrid.demo._rank``, handed its job (the function and
its arguments, pickled; a function of a script's ``__main__`` by value through cloudpickle) on
stdin. It does not run the caller's script again, as ``multiprocessing``'s spawn does to find its
``__main__``: a script that calls :func:`spawn_world` (or ``hybrid.parity.run``) at module level,
with no ``if __name__ == "__main__"`` guard, works as written. Ranks report progress, their result
or their traceback over a local authenticated connection; each one's stderr goes to a file, so a
rank that dies where it cannot report (an import, a signal, ``os._exit``) ends the world within
about a second with its exit code and the last lines it wrote.
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Listener

from hybrid.demo._forked import ServerGone, forking_available, start_rank

COLLECTIVE_TIMEOUT_S = 60  # a rank that dies makes the others fail within this, not hang
_POLL_S = 0.2
_STDERR_TAIL = 40  # lines of a dead rank's stderr shown in the error


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorldCancelled(RuntimeError):
    """:func:`spawn_world` was told to stop (its ``cancel`` event) before rank 0 returned."""


def _dumps(job) -> bytes:
    """The job as a rank unpickles it: by reference where importable, a ``__main__`` function by value."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - the demo and parity extras install it
        return pickle.dumps(job)
    return cloudpickle.dumps(job)


class _Inbox:
    """Messages from the ranks' connections, in one queue: a thread accepts them, one reads each."""

    def __init__(self, listener: Listener, num_ranks: int):
        self.messages: queue.Queue = queue.Queue()
        self._listener = listener
        threading.Thread(target=self._accept, args=(num_ranks,), daemon=True).start()

    def _accept(self, num_ranks: int) -> None:
        for _ in range(num_ranks):
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):  # closed: the world is over
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn) -> None:
        with conn:
            while True:
                try:
                    self.messages.put(conn.recv())
                except (EOFError, OSError):
                    return


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-_STDERR_TAIL:]) or "(it wrote nothing to stderr)"


def _start(rank: int, world_size: int, port: int, listener: Listener, authkey: bytes, job: bytes,
           report_progress: bool, log) -> subprocess.Popen:
    header = {"rank": rank, "world_size": world_size, "port": port, "address": listener.address,
              "authkey": authkey, "report_progress": report_progress and rank == 0, "sys_path": list(sys.path),
              "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    if forking_available():
        try:
            return start_rank(pickle.dumps((header, job)), stderr=log)  # forked from this process's rank server
        except ServerGone:  # it could not start (its error is on stderr): a fresh rank says why in its own log
            pass
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.demo._rank"], stdin=subprocess.PIPE, stderr=log)
    try:
        proc.stdin.write(pickle.dumps((header, job)))
        proc.stdin.close()
    except BrokenPipeError:  # it died at once: its exit code and stderr say why
        pass
    return proc


def spawn_world(fn, *args, world_size: int = 2, progress: Callable | None = None, timeout_s: float = 600,
                cancel: threading.Event | None = None, **kwargs):
    """``fn(*args, **kwargs, progress=...)`` on every rank of a gloo world of ``world_size``
    fresh processes on 127.0.0.1 (numerics pinned); returns rank 0's return value.

    ``fn`` and its arguments are pickled to the ranks (cloudpickle: a function of a script's
    ``__main__`` travels by value); the caller's script is not run again in them. ``fn``'s
    ``progress`` is ``None`` except on rank 0 when ``progress`` is given here: then each
    ``progress(*a)`` it makes is called here, in the caller. A rank that raises is raised here as
    a RuntimeError with that rank's traceback; one that dies without a word (at import, killed,
    ``os._exit``) within about a second, with its exit code and the end of its stderr. Setting
    ``cancel`` stops the world (:class:`WorldCancelled`); ``timeout_s`` bounds the whole run.

    >>> from hybrid.demo import TrainConfig, train_torch
    >>> spawn_world(train_torch, TrainConfig(num_steps=3), world_size=2).losses.shape
    (3,)
    """
    job = _dumps((fn, args, kwargs))
    authkey = secrets.token_bytes(32)
    port = free_port()
    logs = [tempfile.TemporaryFile() for _ in range(world_size)]
    procs: list[subprocess.Popen] = []
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        inbox = _Inbox(listener, world_size)
        try:
            procs = [_start(r, world_size, port, listener, authkey, job, progress is not None, logs[r])
                     for r in range(world_size)]
            value = _collect(inbox.messages, procs, logs, world_size, progress, time.monotonic() + timeout_s,
                             timeout_s, cancel)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    return value


def _collect(messages: queue.Queue, procs, logs, world_size: int, progress, deadline: float, timeout_s: float,
             cancel):
    """Rank 0's result, calling ``progress`` on the way; raises for a rank that fails or dies.

    A rank that dies without a word is the cause the others' errors follow from (a peer gone
    mid-collective), so it is named first, with their first report after it.
    """
    while True:
        try:
            msg = messages.get(timeout=_POLL_S)
        except queue.Empty:
            if cancel is not None and cancel.is_set():
                raise WorldCancelled(f"spawn_world: cancelled before rank 0 of {world_size} returned")
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawn_world: no result from {world_size} ranks within {timeout_s} s")
            # A rank that exited with an error, or rank 0 gone without its result: only a report
            # still in flight can explain it.
            if any(p.poll() is not None and (p.poll() or r == 0) for r, p in enumerate(procs)):
                msg = _next_or_none(messages, 1.0)
                if msg is None:
                    _raise_silent_death(procs, logs, world_size, rank0_clean_exit=True)
            else:
                continue
        if msg[0] == "progress":
            progress(*msg[1])
        elif msg[0] == "error":
            time.sleep(0.5)  # a peer's death makes the others fail within milliseconds: let its exit show
            reported = {msg[1]} | _ranks_that_reported(messages)  # they exit non-zero too, having said why
            _raise_silent_death(procs, logs, world_size, after=f"rank {msg[1]} then failed:\n{msg[2]}",
                                reported=reported)
            raise RuntimeError(f"spawn_world: rank {msg[1]} of {world_size} failed:\n{msg[2]}")
        else:
            return msg[1]


def _next_or_none(messages: queue.Queue, wait_s: float):
    try:
        return messages.get(timeout=wait_s)
    except queue.Empty:
        return None


def _ranks_that_reported(messages: queue.Queue) -> set[int]:
    """The ranks whose tracebacks are waiting in ``messages`` (taken from it)."""
    ranks = set()
    while (msg := _next_or_none(messages, 0.0)) is not None:
        if msg[0] == "error":
            ranks.add(msg[1])
    return ranks


def _raise_silent_death(procs, logs, world_size: int, *, after: str = "", reported: set[int] = frozenset(),
                        rank0_clean_exit: bool = False) -> None:
    """Raise for the first rank that exited non-zero without a traceback (``reported``: the ranks
    that sent one; with ``rank0_clean_exit`` also rank 0 gone without its result): its exit code and
    the end of its stderr, then ``after``."""
    for rank, p in enumerate(procs):
        code = p.poll()
        if rank not in reported and code is not None and (code or (rank == 0 and rank0_clean_exit)):
            then = f"\n\n{after}" if after else ""
            raise RuntimeError(f"spawn_world: rank {rank} of {world_size} died ({_exit_text(code)}) without "
                               f"reporting; the end of its stderr:\n{_tail(logs[rank])}{then}")
