"""Listening sockets for ``serve --workers N``: one ``SO_REUSEPORT`` socket per worker.

With one socket shared by the workers, whichever worker is idle in ``accept`` at the moment
takes a new connection, and keep-alive clients stay where they landed, so the split between
workers can be as lopsided as all-to-one (docs/serving.md). On Linux every worker therefore
listens on a socket of its own, all bound with ``SO_REUSEPORT``, and the kernel spreads new
connections over them by a hash of the client's address and port.

Standard library only: the supervisor imports this (and a spawned worker unpickles it) before
anything heavy is loaded.
"""

from __future__ import annotations

import socket
import sys


def reuseport_supported() -> bool:
    """``SO_REUSEPORT`` that balances (Linux >= 3.9; BSD and macOS accept the option but do not
    spread connections)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


class ReusePortSocket(socket.socket):
    """A bound ``SO_REUSEPORT`` socket that, handed to a spawned worker, arrives as a new socket
    of that worker's own on the same address (instead of a duplicate of this one).

    uvicorn's supervisor binds in the parent and pickles the socket into each spawned worker;
    this ``__reduce__`` makes that transfer re-bind, so every worker listens on its own socket of
    one ``SO_REUSEPORT`` group. The parent's socket only reserves the address: it never
    listens, so the kernel never gives it a connection.
    """

    def __reduce__(self) -> tuple[object, tuple[int, str, int]]:
        host, port = self.getsockname()[:2]
        return reuseport_socket, (int(self.family), host, port)


def reuseport_socket(family: int, host: str, port: int) -> ReusePortSocket:
    """A socket bound to ``(host, port)`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT``."""
    sock = ReusePortSocket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
