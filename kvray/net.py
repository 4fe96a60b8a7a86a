"""Small network helpers shared by the rooms (no kvray imports)."""

from __future__ import annotations

import errno
import socket
import sys
import time


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on `host` ("" = every interface)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_sockets(port: int) -> set[str] | None:
    """The sockets of this machine listening on TCP `port`, as their /proc/<pid>/fd link
    targets ("socket:[inode]"), read from Linux's /proc/net; None where that cannot be
    read."""
    try:
        tables = [open(f"/proc/net/{t}").read().splitlines()[1:] for t in ("tcp", "tcp6")]
    except OSError:
        return None
    # Each row: sl local_address(hex ip:hex port) rem_address st ... inode; st 0A is LISTEN.
    return {
        f"socket:[{f[9]}]"
        for rows in tables
        for f in (row.split() for row in rows)
        if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A"
    }


def wait_for_port(host: str, port: int, wait_s: float = 65.0) -> OSError | None:
    """Wait until a socket without SO_REUSEADDR (as Ray Serve binds) can listen on
    host:port; the error if none can: another server listens there (or /proc/net, which
    tells, cannot be read), or `wait_s` passed. Such a bind fails for a minute after a
    server on the port closed connections (TIME_WAIT), which is what a restarted server
    meets."""
    deadline = time.monotonic() + wait_s
    noted = False
    while True:
        try:
            with socket.socket(_family(host), socket.SOCK_STREAM) as s:
                s.bind((host, port))
            return None
        except OSError as e:
            if e.errno != errno.EADDRINUSE or listening_sockets(port) != set():
                return e
            if time.monotonic() > deadline:
                return e
            if not noted:
                print(f"port {port} is held by closed connections; waiting", file=sys.stderr)
                noted = True
        time.sleep(1.0)
