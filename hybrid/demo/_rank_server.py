"""The process :func:`hybrid.demo.spawn_world` forks its ranks from: ``python -m hybrid.demo._rank_server FD``.

A rank's first 2-3 CPU-seconds are imports (torch, torch.distributed and the optimizers behind
hybrid's torch runner, which pull in ``torch._dynamo``), paid again by every rank of every world.
This server pays them once: it imports what a rank imports, then, for each request on its socket
(``FD``, one end of a Unix socket pair), forks a child that becomes that rank (``_rank.run``) with
the caller's stdout, stderr file, working directory and environment. It imports no JAX and starts
no thread and no torch computation, so a fork of it is as clean as a fresh interpreter that has
imported the same modules; it never runs the caller's ``__main__``.

Requests: an 8-byte length with two file descriptors attached (the rank's stdout and stderr), then
that many bytes: a pickled ``{"rank_input", "cwd", "environ"}``. Answers, each an 8-byte length
and a pickled tuple: ``("started", pid)`` per request, in order, and ``("exited", pid, code)``
when a child ends (``code`` as ``subprocess.Popen.returncode``: negative for a signal). The
server ends when its socket closes: the caller is gone.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import sys

from hybrid.demo._rank_wire import LENGTH, recv_exact, send_message

_POLL_S = 0.05  # how soon a child's exit is reported


def _recv_request(sock: socket.socket):
    """``(payload, [stdout_fd, stderr_fd])``, or None once the caller has closed its end."""
    head, fds, _, _ = socket.recv_fds(sock, LENGTH.size, 2)
    if not head:
        return None
    rest = recv_exact(sock, LENGTH.size - len(head)) if len(head) < LENGTH.size else b""
    if rest is None:
        return None
    payload = recv_exact(sock, LENGTH.unpack(head + rest)[0])
    return None if payload is None else (payload, fds)


def _become_rank(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """In the forked child: take the request's streams, directory and environment, run the rank, exit."""
    code = 1
    try:
        sock.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        request = pickle.loads(payload)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environ"])
        from hybrid.demo import _rank

        code = _rank.run(request["rank_input"])
    except BaseException:  # noqa: BLE001 - said on the rank's stderr, which the caller shows
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting either way
                pass
        # Not sys.exit: the server's own exit handlers and finalizers are not this rank's.
        os._exit(code)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send_message(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    while True:
        ready, _, _ = select.select([sock], [], [], _POLL_S)
        _report_exits(sock)
        if not ready:
            continue
        request = _recv_request(sock)
        if request is None:
            return  # the caller is gone; the ranks still running finish on their own
        payload, fds = request
        pid = os.fork()
        if pid == 0:
            _become_rank(sock, payload, fds)
        for f in fds:
            os.close(f)
        send_message(sock, ("started", pid))


def main() -> None:
    fd = int(sys.argv[1])
    # What every rank imports before its job; the job's own modules are imported by each rank.
    import multiprocessing.connection  # noqa: F401
    import torch.distributed  # noqa: F401

    import hybrid.demo._rank  # noqa: F401
    import hybrid.demo._torch_run  # noqa: F401 - torch, hybrid.torch, the optimizers, torch._dynamo
    serve(fd)


if __name__ == "__main__":
    main()
