"""``serving.sockets``: the socket a spawned worker receives is a new one on the same port."""

import pickle
import socket
from multiprocessing.reduction import ForkingPickler

import pytest

from serving.sockets import ReusePortSocket, reuseport_socket, reuseport_supported

pytestmark = pytest.mark.skipif(not reuseport_supported(), reason="SO_REUSEPORT balancing: Linux")


def test_a_transferred_socket_arrives_as_a_new_socket_on_the_same_address() -> None:
    parent = reuseport_socket(socket.AF_INET, "127.0.0.1", 0)
    port = parent.getsockname()[1]
    children = [pickle.loads(ForkingPickler.dumps(parent)) for _ in range(2)]  # as spawn does
    try:
        for c in children:
            assert isinstance(c, ReusePortSocket) and c.getsockname() == ("127.0.0.1", port)
            assert c.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            c.listen()
        assert len({parent.fileno(), *(c.fileno() for c in children)}) == 3
        # the parent only reserves the address: connections reach the listening children
        for _ in range(8):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        accepted = 0
        for c in children:
            c.setblocking(False)
            while True:
                try:
                    conn, _ = c.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted += 1
        assert accepted == 8
    finally:
        for s in (parent, *children):
            s.close()


def test_a_taken_port_is_an_error_and_leaks_no_socket() -> None:
    with socket.socket() as other:  # bound without SO_REUSEPORT: the port is not shareable
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            reuseport_socket(socket.AF_INET, "127.0.0.1", other.getsockname()[1])
