"""The fault tests' TCP proxy (tests/support/netfault.py) over a long run: a
campaign's process opens thousands of connections through it."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.netfault import Proxy


@pytest.fixture
def echo() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=2)
        server.close()


def round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(payload)
        return conn.recv(1024)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_link_opened_above_descriptor_1024_is_relayed(echo):
    """select() refuses a descriptor above 1024; a campaign's process gets
    there, and every link it opened after that died at once."""
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with Proxy("127.0.0.1", echo, name="t-fd") as proxy:
            assert round_trip(proxy.port, b"ping") == b"ping"
    finally:
        for fd in filler:
            os.close(fd)


def test_a_closed_link_gives_its_descriptors_back(echo):
    with Proxy("127.0.0.1", echo, name="t-leak") as proxy:
        round_trip(proxy.port, b"warm")
        before = open_descriptors()
        for _ in range(200):
            assert round_trip(proxy.port, b"x") == b"x"
        deadline = threading.Event()
        for _ in range(50):  # each link's pumps notice its end within one poll
            if not proxy.open_links() and open_descriptors() <= before + 4:
                break
            deadline.wait(0.1)
        assert open_descriptors() <= before + 4, (before, open_descriptors())
