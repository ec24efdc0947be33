"""The framing between :mod:`hybrid.demo._forked` and its rank server: an 8-byte length, then that
many bytes of pickle."""

from __future__ import annotations

import pickle
import socket
import struct

LENGTH = struct.Struct("<Q")


def send_message(sock: socket.socket, message) -> None:
    data = pickle.dumps(message)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at end of stream."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket):
    """The next :func:`send_message`'s message, or None at end of stream."""
    head = recv_exact(sock, LENGTH.size)
    body = None if head is None else recv_exact(sock, LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)
