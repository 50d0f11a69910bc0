"""The fault-injection proxy itself: it forwards, stalls, refuses and cuts as the outage tests need."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from tests.fixtures.faultproxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy("127.0.0.1", server.server_address[1]) as fp:
        yield fp
    server.shutdown()
    server.server_close()


def _roundtrip(port: int, payload: bytes = b"ping", timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        return sock.recv(4096)


def test_forwards_both_ways(proxy: FaultProxy) -> None:
    assert _roundtrip(proxy.port, b"hello") == b"hello"
    assert proxy.forwarded == 1


def test_refuse_resets_new_connections_and_heal_restores_them(proxy: FaultProxy) -> None:
    proxy.refuse()
    with pytest.raises(OSError):
        _roundtrip(proxy.port)
    assert proxy.wait_for_attempt(1, timeout=30)
    proxy.heal()
    assert _roundtrip(proxy.port) == b"ping"


def test_drop_cuts_open_connections(proxy: FaultProxy) -> None:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.sendall(b"a")
    assert sock.recv(16) == b"a"
    assert proxy.drop() == 1
    with pytest.raises(OSError):
        # a reset peer fails the next send or recv (which one depends on timing)
        for _ in range(100):
            sock.sendall(b"b")
            if not sock.recv(16):
                raise ConnectionResetError("closed")
    sock.close()


def test_stall_holds_bytes_until_heal(proxy: FaultProxy) -> None:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    proxy.stall()
    sock.sendall(b"held")
    sock.settimeout(0.3)
    with pytest.raises(socket.timeout):
        sock.recv(16)  # nothing may arrive while stalled (a short wait proves nothing came back)
    proxy.heal()
    sock.settimeout(30)
    assert sock.recv(16) == b"held"
    sock.close()
