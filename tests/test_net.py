"""kvray.net's port helpers, on real sockets: `wait_for_port` tells a port another server
listens on (an error at once) from one held only by closed connections in TIME_WAIT (it
waits), as a restarted `kvray serve` meets them."""

from __future__ import annotations

import errno
import socket

import pytest

from kvray.net import free_port, wait_for_port


def test_a_free_port_is_there_at_once() -> None:
    assert wait_for_port("127.0.0.1", free_port("127.0.0.1"), wait_s=0.0) is None


def test_a_port_another_server_listens_on_is_an_error_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        err = wait_for_port("127.0.0.1", port, wait_s=60.0)  # no wait: returns at once
    assert err is not None and err.errno == errno.EADDRINUSE
    assert "waiting" not in capsys.readouterr().err


def test_a_port_held_by_closed_connections_is_waited_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A server bound as Serve binds (no SO_REUSEADDR) closes its side of a connection
    # first, then stops listening: its port stays in TIME_WAIT for a minute.
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()
    client.recv(1)  # the server's FIN has arrived
    client.close()
    server.close()
    err = wait_for_port("127.0.0.1", port, wait_s=1.5)
    # Not free within 1.5 s (TIME_WAIT lasts 60 s), but waited for, not refused.
    assert err is not None and err.errno == errno.EADDRINUSE
    assert f"port {port} is held by closed connections; waiting" in capsys.readouterr().err
