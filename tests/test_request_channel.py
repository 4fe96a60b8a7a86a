"""The request channel (kvray.cluster.request_channel) between a front end and a scheduler,
in one process over a real Unix socket: a submit answered with its id before its events,
a rejection raised as the engine raised it, aborts that reach the scheduler, a front end
that goes away aborting what it left running, and a scheduler that goes away failing every
request on the channel."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Sequence

import pytest

from kvray.cluster.request_channel import ChannelGone, RequestChannel, RequestChannelServer
from kvray.core import FinishReason, RequestRejected, SamplingParams, TokenEvent


class FakeScheduler:
    """The scheduler actor's side of the callbacks: numbers requests, records aborts."""

    def __init__(self) -> None:
        self.requests: dict[int, tuple[str, list[int]]] = {}
        self.aborts: list[tuple[str, int, str]] = []
        self.closed: list[str] = []
        self.server = RequestChannelServer(self.submit, self.abort, self.closed.append)

    def submit(self, input_ids: Sequence[int], sampling: SamplingParams, owner: str) -> int:
        if not input_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        rid = 100 + len(self.requests)
        self.requests[rid] = (owner, list(input_ids))
        return rid

    def abort(self, owner: str, rid: int, reason: str) -> None:
        self.aborts.append((owner, rid, reason))


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    async def wait() -> None:
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout_s)


def test_requests_and_their_events_round_trip() -> None:
    async def main() -> None:
        sched = FakeScheduler()
        # Only this user can reach the socket.
        assert stat.S_IMODE(os.stat(os.path.dirname(sched.server.path)).st_mode) == 0o700
        # The socket listens from the start: a front end that connects before the server
        # runs waits in the backlog and is served once it does.
        channel = await RequestChannel.connect(sched.server.path)
        await sched.server.start()
        sampling = SamplingParams(temperature=0.0, max_tokens=2)
        rid, queue = await channel.submit([1, 2, 3], sampling)
        owner, ids = sched.requests[rid]
        assert ids == [1, 2, 3] and owner.startswith("channel-")

        # A step's events of this connection's requests, in one frame.
        rid2, queue2 = await channel.submit([4], sampling)
        assert sched.server.send(owner, [TokenEvent(rid, 7), TokenEvent(rid2, 8)])
        assert (await queue.get()).token_id == 7
        assert (await queue2.get()).token_id == 8
        assert not sched.server.send("channel-999", [TokenEvent(rid, 9)])  # no such front end

        # The engine's rejection is raised as it was raised, with its field.
        with pytest.raises(RequestRejected, match="empty") as info:
            await channel.submit([], sampling)
        assert info.value.param == "prompt"

        # An abort reaches the scheduler with the request's owner; finishing events
        # end a request's entry on the front end.
        channel.abort(rid, "stop")
        await _until(lambda: sched.aborts == [(owner, rid, "stop")])
        sched.server.send(owner, [TokenEvent(rid, None, finish_reason=FinishReason.STOP)])
        assert (await queue.get()).finished

        # The front end goes away: the scheduler hears of it (and aborts what is left).
        channel.close()
        await _until(lambda: sched.closed == [owner])
        sched.server.close()

    asyncio.run(main())


def test_a_scheduler_that_goes_away_fails_every_request_on_the_channel() -> None:
    async def main() -> None:
        sched = FakeScheduler()
        await sched.server.start()
        channel = await RequestChannel.connect(sched.server.path)
        _, queue = await channel.submit([1], SamplingParams(max_tokens=4))
        sched.server.close()
        assert isinstance(await asyncio.wait_for(queue.get(), 5), ChannelGone)
        assert isinstance(channel.failure, ChannelGone)
        with pytest.raises(ChannelGone):
            await channel.submit([2], SamplingParams(max_tokens=4))
        # Nothing listens at the path any more.
        with pytest.raises(ChannelGone):
            await RequestChannel.connect(sched.server.path, timeout_s=2)

    asyncio.run(main())


def test_a_submitter_cancelled_before_the_answer_leaves_nothing_running() -> None:
    async def main() -> None:
        sched = FakeScheduler()
        await sched.server.start()
        channel = await RequestChannel.connect(sched.server.path)
        task = asyncio.ensure_future(channel.submit([5, 6], SamplingParams(max_tokens=4)))
        await asyncio.sleep(0)  # the submit is written
        task.cancel()
        # The answer arrives for a request nobody will read: the front end aborts it.
        await _until(lambda: len(sched.aborts) == 1)
        ((_owner, rid, reason),) = sched.aborts
        assert rid in sched.requests and reason == "abort"
        channel.close()
        sched.server.close()

    asyncio.run(main())
