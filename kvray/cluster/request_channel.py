"""A direct request channel from a front end (the Serve ingress) to a scheduler actor on the
same node: one Unix socket per front-end process (and event loop), carrying its submits and
aborts in and every event of its requests out.

Through Serve, a request takes two Ray hops before its scheduler has it (ingress -> engine
replica through Serve's handle, replica -> scheduler actor: ~7 ms on a loaded 2-core node),
and each step's events take one more (a streaming actor call), with CPU spent in every
process on the way, on the cores the step computes on. Over the socket the scheduler has
the request within a fraction of a millisecond and writes each step's events as one frame.

Only this user's processes may connect (the socket is in a 0700 directory and every
connection's peer is checked with SO_PEERCRED). Frames are step_channel's: pickles between
kvray's own processes (a client's request was parsed and checked by the ingress before it
is framed here).

Front end -> scheduler:
    ("submit", tag, input_ids, sampling)  answered ("submitted", tag, rid)
                                          or ("rejected", tag, exception)
    ("abort", rid, reason)                the request's finishing event follows
Scheduler -> front end:
    ("events", [TokenEvent, ...])         what a step produced for this connection's requests

A submit is answered before any event of its request (both are written on the scheduler's
event loop, the answer first). A connection that closes aborts the requests it submitted
that are still running: the front end went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import shutil
import socket
from collections.abc import Callable, Sequence
from typing import Any

from kvray.cluster.step_channel import frame, peer_is_this_user, private_socket_path, read_frame
from kvray.core import SamplingParams, TokenEvent

Submit = Callable[[Sequence[int], SamplingParams, str], int]
Abort = Callable[[str, int, str], None]


class ChannelGone(ConnectionError):
    """The scheduler's end of the channel closed (the engine is gone or restarting)."""


class RequestChannelServer:
    """The scheduler's end: accepts front ends' connections on its event loop. Each
    connection is an owner key (`channel-N`): `submit(ids, sampling, key)` queues a request
    for it (returns the rid, raises RequestRejected), `abort(key, rid, reason)` ends one,
    `closed(key)` is called once the connection is gone; `send(key, events)` writes events."""

    def __init__(self, submit: Submit, abort: Abort, closed: Callable[[str], None]) -> None:
        self._submit, self._abort, self._closed = submit, abort, closed
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._keys = itertools.count()
        self._dir, self.path = private_socket_path("kvray-requests-")
        # Listening from here on: a front end that connects before `start` is served waits
        # in the backlog, so a second caller may hand out the path while the first starts.
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Serve the connections (on the running event loop)."""
        self._server = await asyncio.start_unix_server(self._serve, sock=self._listener)

    @property
    def connections(self) -> int:
        """Front ends connected now."""
        return len(self._writers)

    def send(self, key: str, events: list[TokenEvent]) -> bool:
        """Write `events` to connection `key`; False if it has no such connection."""
        writer = self._writers.get(key)
        if writer is None or writer.is_closing():
            return False
        writer.write(frame(("events", events)))
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not peer_is_this_user(writer.get_extra_info("socket")):
            writer.close()
            return
        key = f"channel-{next(self._keys)}"
        self._writers[key] = writer
        try:
            while True:
                msg = await read_frame(reader)
                if msg[0] == "submit":
                    _, tag, input_ids, sampling = msg
                    try:
                        answer = ("submitted", tag, self._submit(input_ids, sampling, key))
                    except Exception as e:  # noqa: BLE001 - the front end raises it
                        answer = ("rejected", tag, e)
                    writer.write(frame(answer))
                elif msg[0] == "abort":
                    _, rid, reason = msg
                    self._abort(key, rid, reason)
                else:
                    raise ValueError(f"unknown request-channel message {msg[0]!r}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end went away
        finally:
            del self._writers[key]
            self._closed(key)
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        for writer in self._writers.values():
            writer.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RequestChannel:
    """The front end's end, on the event loop that connected it. `submit` returns a
    request's id and the queue its events arrive in; once the channel breaks, every
    request on it gets a ChannelGone in its queue and `failure` is set."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._tags = itertools.count()
        self._pending: dict[int, asyncio.Future[tuple[int, asyncio.Queue[Any]]]] = {}
        self._queues: dict[int, asyncio.Queue[TokenEvent | BaseException]] = {}
        self.failure: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        # In a fresh context: a task created in a request's context is that request's
        # child, and Serve cancels a request's children with it (the reader is shared).
        self._task = self._loop.create_task(self._read(), context=contextvars.Context())

    @classmethod
    async def connect(cls, path: str, timeout_s: float = 10.0) -> RequestChannel:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout_s)
        except (OSError, TimeoutError) as e:
            raise ChannelGone(f"no request channel at {path} ({type(e).__name__})") from None
        return cls(reader, writer)

    def on_this_loop(self) -> bool:
        return self._loop is asyncio.get_running_loop()

    async def _read(self) -> None:
        try:
            while True:
                msg = await read_frame(self._reader)
                if msg[0] == "events":
                    for ev in msg[1]:
                        if (q := self._queues.get(ev.rid)) is not None:
                            q.put_nowait(ev)
                            if ev.finished:
                                del self._queues[ev.rid]
                    continue
                kind, tag, value = msg
                fut = self._pending.pop(tag)
                if kind == "rejected":
                    if not fut.done():
                        fut.set_exception(value)
                    continue
                if fut.done():  # the submitter was cancelled meanwhile: nobody will read
                    self.abort(value, "abort")
                    continue
                queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
                self._queues[value] = queue
                fut.set_result((value, queue))
        except BaseException as e:  # noqa: BLE001 - every request on the channel gets it
            gone = ChannelGone(f"the engine's request channel closed ({type(e).__name__})")
            self.failure = gone
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(gone)
            for q in self._queues.values():
                q.put_nowait(gone)
            self._pending.clear()
            self._queues.clear()
            self._writer.close()

    async def submit(
        self, input_ids: Sequence[int], sampling: SamplingParams
    ) -> tuple[int, asyncio.Queue[TokenEvent | BaseException]]:
        """Queue a request: (its id, its events' queue). Raises what the engine raised
        (RequestRejected) or ChannelGone."""
        if self.failure is not None:
            raise self.failure
        tag = next(self._tags)
        fut: asyncio.Future[tuple[int, asyncio.Queue[Any]]] = self._loop.create_future()
        self._pending[tag] = fut
        self._writer.write(frame(("submit", tag, list(input_ids), sampling)))
        return await fut

    def abort(self, rid: int, reason: str) -> None:
        """End request `rid` (fire and forget: its finishing event follows)."""
        if self.failure is None:
            self._writer.write(frame(("abort", rid, reason)))

    def forget(self, rid: int) -> None:
        """Nobody reads request `rid`'s events any more."""
        self._queues.pop(rid, None)

    def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(RuntimeError):
            self._writer.close()
