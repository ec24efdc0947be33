"""Ranks forked from one preloaded server (``hybrid.demo._rank_server``) per calling process.

:func:`start_rank` returns a handle with the part of ``subprocess.Popen`` that
:func:`hybrid.demo.spawn_world` uses (``pid``, ``poll``, ``wait``, ``kill``). The server starts
with the first rank and serves every later world of this process, so its imports are paid once;
it ends when this process does (its socket closes). A rank gets this process's working
directory and environment as they are when the rank starts; what torch reads from the environment
at import (``TORCH_LOGS``, say) is read once, when the server starts. ``HYBRID_FRESH_RANKS=1``
makes ``spawn_world`` start each rank as a fresh interpreter instead (2-3 CPU-seconds each).

>>> import os
>>> rank = start_rank(b"not a pickle", stderr=open(os.devnull, "wb"))
>>> rank.wait(timeout=60)  # the rank could not read its input: exit code 1
1
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

from hybrid.demo._rank_wire import LENGTH, recv_message

SERVER_MODULE = "hybrid.demo._rank_server"  # run as python -m SERVER_MODULE FD
_UNKNOWN_EXIT = 255  # a rank that ended after its server died: its status is lost


class ServerGone(RuntimeError):
    """The rank server ended before it forked the rank asked for (it could not start, say)."""


class ForkedRank:
    """One forked rank: ``Popen``'s ``pid``, ``poll()``, ``wait(timeout)`` and ``kill()``."""

    def __init__(self, server: "_Server", pid: int):
        self._server, self.pid = server, pid

    def poll(self) -> int | None:
        return self._server.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return code

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Server:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time: answers come in request order
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="hybrid-rank-server").start()

    def _read(self) -> None:
        while True:
            try:
                message = recv_message(self.sock)
            except OSError:
                message = None
            with self._changed:
                if message is None:
                    self.alive = False
                    self._changed.notify_all()
                    return
                if message[0] == "started":
                    self._started.append(message[1])
                else:
                    self._exits[message[1]] = message[2]
                self._changed.notify_all()

    def start(self, rank_input: bytes, stdout: int, stderr: int) -> ForkedRank:
        request = pickle.dumps({"rank_input": rank_input, "cwd": os.getcwd(), "environ": dict(os.environ)})
        with self._lock:
            try:
                socket.send_fds(self.sock, [LENGTH.pack(len(request))], [stdout, stderr])
                self.sock.sendall(request)
            except OSError as e:  # it ended since the last rank (killed, say)
                raise ServerGone(f"spawn_world: the rank server ended ({self._server_exit()}): {e}") from e
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or not self.alive, timeout=60):
                    raise RuntimeError("spawn_world: the rank server did not fork a rank within 60 s")
                if not self._started:
                    raise ServerGone(f"spawn_world: the rank server ended ({self._server_exit()})")
                return ForkedRank(self, self._started.pop(0))

    def _server_exit(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else f"exit code {code}"

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if not self.alive:  # nobody reports for it any more: gone is all that can be known
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    self._exits[pid] = _UNKNOWN_EXIT
                    return _UNKNOWN_EXIT
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive, timeout=timeout)
        code = self.exit_code(pid)
        if code is None and not self.alive:  # orphaned: poll until it is gone or the time is up
            end = None if timeout is None else time.monotonic() + timeout
            while code is None and (end is None or time.monotonic() < end):
                time.sleep(0.05)
                code = self.exit_code(pid)
        return code

    def close(self) -> None:
        # shutdown, not just close: the reader thread's pending recv keeps the socket open until
        # it returns, and shutdown is what ends it and tells the server its caller is gone.
        with self._changed:
            self.alive = False  # the next rank starts a new server
            self._changed.notify_all()
        for end in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                end()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: _Server | None = None
_server_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _server_lock:
        # A fork of this process starts with none (_forget_server_in_child)
        if _server is None or not _server.alive:
            if _server is not None:
                _server.close()
            _server = _Server()
        return _server


def forking_available() -> bool:
    """Ranks fork from a server on Linux, unless ``HYBRID_FRESH_RANKS=1`` (elsewhere a fork of a
    process that imported torch is not known to be safe: macOS's runtimes refuse some)."""
    return sys.platform == "linux" and os.environ.get("HYBRID_FRESH_RANKS") != "1"


def start_rank(rank_input: bytes, *, stderr, stdout=None) -> ForkedRank:
    """Fork a rank from this process's rank server (started on first use) and hand it
    ``rank_input`` (``hybrid.demo._rank``'s pickled ``(header, job)``); its stderr goes to
    ``stderr`` (a file), its stdout to ``stdout`` (default: this process's)."""
    out = 1 if stdout is None else stdout.fileno()  # fd 1 as it is now, as a Popen child inherits it
    return _get_server().start(rank_input, out, stderr.fileno())


def _forget_server_in_child() -> None:
    """A fork of this process keeps no copy of the server's socket: held open there, it would keep
    the server alive after this process ends. Only the child's copy is closed (no shutdown)."""
    global _server
    if _server is not None:
        try:
            _server.sock.close()
        except OSError:
            pass
        _server = None


os.register_at_fork(after_in_child=_forget_server_in_child)


@atexit.register
def _close_server() -> None:
    if _server is not None:
        _server.close()
