"""Small network helpers shared by the rooms (no kvray imports)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on `host` ("" = every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
