"""A direct step channel from the scheduler to a worker actor on the same node: a Unix
socket each way of which carries one plan in and one answer out per step.

A plain Ray actor call costs ~2-3 ms of wall time each way on a loaded 2-core node, and CPU
time in both processes on the cores the step computes on (the call's submission, the
object store, the raylet's bookkeeping), every step. A compiled graph's channels are
fast, but their readers busy-wait and keep a core spinning (`ray_executor`). A socket read
blocks in the kernel, and a plan is a few hundred bytes of numpy arrays: a round trip is
tens of microseconds.

Only the worker's own scheduler may connect: the socket lives in a directory only this
user can enter (mode 0700), the first connection must come from this user (SO_PEERCRED),
and the path is gone once it is accepted. Plans and answers are pickled, as Ray pickles
them; nothing a client sends travels here unchecked (plans are the scheduler's own).

Frames: an 8-byte little-endian length, then the pickle. A worker answers every plan:
`(True, result)` or `(False, error text)` when the step raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_LEN = struct.Struct("<Q")


class ChannelClosed(ConnectionError):
    """The other end went away (its process died or closed the channel)."""


class StepFailed(RuntimeError):
    """A rank's step raised (the worker's error text)."""


def frame(obj: Any) -> bytes:
    """`obj` as one frame: its pickle's length, then the pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the step channel closed")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """`recv_frame` on an asyncio stream (raises IncompleteReadError once it closes)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))


def peer_is_this_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of Unix socket `conn` runs as this user."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def private_socket_path(prefix: str) -> tuple[str, str]:
    """(a new directory only this user can enter (mode 0700), a socket path in it)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    return directory, os.path.join(directory, "sock")


class StepServer:
    """The worker's end: listens at `path` for its scheduler's one connection, then runs
    `handler` on every plan that comes, on a thread of its own, until the channel closes."""

    def __init__(self, handler: Callable[[Any], Any], accept_timeout_s: float = 60.0) -> None:
        self._handler = handler
        self._dir, self.path = private_socket_path("kvray-step-")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._listener.settimeout(accept_timeout_s)
        self._thread = threading.Thread(target=self._serve, name="kvray-step-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> socket.socket | None:
        try:
            while True:
                conn, _ = self._listener.accept()
                if peer_is_this_user(conn):
                    return conn
                conn.close()
        except OSError:  # no scheduler came in time
            return None
        finally:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            while True:
                try:
                    plan = recv_frame(conn)
                except (ChannelClosed, OSError):
                    return
                try:
                    answer: tuple[bool, Any] = (True, self._handler(plan))
                except Exception as e:  # noqa: BLE001 - the scheduler decides what follows
                    answer = (False, f"{type(e).__name__}: {e}")
                try:
                    conn.sendall(frame(answer))
                except OSError:
                    return


class StepClient:
    """The scheduler's end of the channels to every rank of a TP group, in rank order."""

    def __init__(self, paths: Sequence[str], connect_timeout_s: float = 30.0) -> None:
        self.socks: list[socket.socket] = []
        try:
            for path in paths:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(connect_timeout_s)
                s.connect(path)
                s.settimeout(None)
                self.socks.append(s)
        except BaseException:
            self.close()
            raise
        # One selector for the channel's life: a new epoll per step cost ~0.1 ms of the
        # scheduler's turn-around. Between calls every rank is registered.
        self._selector = selectors.DefaultSelector()
        for rank, s in enumerate(self.socks):
            self._selector.register(s, selectors.EVENT_READ, rank)

    def send(self, plan: Any) -> None:
        """The plan to every rank (pickled once)."""
        data = frame(plan)
        for s in self.socks:
            s.sendall(data)

    def recv(self, timeout_s: float) -> Any:
        """Every rank's answer to the oldest plan sent; rank 0's result. Raises
        ChannelClosed as soon as any rank's end goes (a surviving rank would otherwise
        wait in a collective for its dead peer), StepFailed for a step that raised,
        TimeoutError past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        answers: dict[int, tuple[bool, Any]] = {}
        sel = self._selector
        try:
            while len(answers) < len(self.socks):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer to a step in {timeout_s:.0f} s")
                for key, _ in sel.select(left):
                    rank = key.data
                    answers[rank] = recv_frame(self.socks[rank])
                    # Its next answer (two plans in flight) waits for the next call.
                    sel.unregister(self.socks[rank])
        finally:
            for rank in answers:
                sel.register(self.socks[rank], selectors.EVENT_READ, rank)
        for rank in range(len(self.socks)):
            ok, value = answers[rank]
            if not ok:
                raise StepFailed(f"rank {rank}'s step failed: {value}")
        return answers[0][1]

    def close(self) -> None:
        if (sel := getattr(self, "_selector", None)) is not None:
            sel.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        self.socks = []
