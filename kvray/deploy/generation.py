"""The token loop of the server: an API request's choices running on an engine.

`Generation.start` submits every choice (one engine request each) before anything is
sent to the client, so a prompt the engine rejects is a 400 even for a stream.
`deltas()` then reads each choice's events through its `OutputState` (kvray.text: the
same output path as the offline LLM) and yields the choices' deltas as they come,
observing the request metrics. Framework-free: the engine is reached through the
`AsyncEngineClient` protocol (one async event stream per request; the offline `LLM`
polls through `kvray.cluster.client.EngineClient` instead), and formatting the deltas as
OpenAI responses is `openai.py`'s.

A request ends early in one way only: `EngineStream.cancel()`, after which the engine
aborts it. `close()` does that for every unfinished choice, whatever made the server stop
reading (a client that went away, an error, a sibling choice that was rejected, a health
probe that timed out); a streamed response calls it when it closes (`ChunkStream`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvray.core import FinishReason, RequestRejected, SamplingParams, TokenEvent
from kvray.deploy.metrics import RequestMetrics, RequestTracker
from kvray.deploy.protocol import APIError
from kvray.text import OutputDelta, OutputState

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """What an engine serves, as it resolved it: the longest sequence (prompt + output:
    the smaller of the model's context and the KV pool), the vocabulary size, and the
    checkpoint's own sampling settings (`EngineSpec.sampling_defaults`)."""

    max_seq_len: int
    vocab_size: int
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()


class EngineStream(Protocol):
    """One engine request's events, in batches, up to its finishing event."""

    def __aiter__(self) -> AsyncIterator[list[TokenEvent]]: ...

    def stop(self) -> None:
        """End the request as finished by a stop string (FinishReason.STOP); its
        finishing event follows on the stream."""

    def cancel(self) -> None:
        """Stop reading: the engine aborts the request (FinishReason.ABORT)."""


class AsyncEngineClient(Protocol):
    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> EngineStream:
        """Submit a request (raises RequestRejected) and return its event stream."""
        ...


@dataclass(frozen=True)
class Job:
    """One choice: an engine request."""

    index: int  # the choice's index in the response
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    delta: OutputDelta


def engine_failure(cause: BaseException | str) -> APIError:
    """A 503: no engine could take the request, or the one serving it failed."""
    message = (
        cause
        if isinstance(cause, str)
        else f"the engine failed while serving this request ({type(cause).__name__}); retry shortly"
    )
    return APIError(503, message, None, "ServiceUnavailableError")


class Generation:
    """The running choices of one request; `outputs[i]` is choice i's output so far."""

    def __init__(
        self,
        jobs: Sequence[Job],
        streams: Sequence[EngineStream],
        tokenizer: Tokenizer | None,
        metrics: RequestMetrics | None,
    ) -> None:
        self._streams = list(streams)
        self.outputs = [OutputState(j.prompt_ids, j.sampling, tokenizer) for j in jobs]
        self._trackers: list[RequestTracker | None] = [
            None if metrics is None else metrics.track(len(j.prompt_ids)) for j in jobs
        ]

    @classmethod
    async def start(
        cls,
        engine: AsyncEngineClient,
        jobs: Sequence[Job],
        tokenizer: Tokenizer | None,
        metrics: RequestMetrics | None = None,
    ) -> Generation:
        """Submit every choice, concurrently. If the engine rejects one (RequestRejected,
        raised as is) or cannot take it (a 503), or the caller is cancelled meanwhile, the
        ones it took are cancelled."""
        submits = [asyncio.ensure_future(engine.generate(j.prompt_ids, j.sampling)) for j in jobs]
        try:
            await asyncio.gather(*submits, return_exceptions=True)
        except BaseException:
            for stream in _taken(submits):
                stream.cancel()
            raise
        streams = _taken(submits)
        if len(streams) == len(jobs):
            return cls(jobs, streams, tokenizer, metrics)
        for stream in streams:
            stream.cancel()
        failure = next(e for s in submits if (e := s.exception()) is not None)
        if isinstance(failure, RequestRejected | APIError):
            raise failure
        raise engine_failure(failure) from None

    async def deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        """Every choice's deltas, choices interleaved as their events arrive, until all
        have finished. However the caller stops, unfinished choices are cancelled."""
        # (choice, a batch of its events | what ended its stream early | None: it ended)
        queue: asyncio.Queue[tuple[int, list[TokenEvent] | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for batch in self._streams[i]:
                    queue.put_nowait((i, batch))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self._streams))]
        try:
            while not all(out.finished for out in self.outputs):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise engine_failure(item)  # the actor or replica went away
                if item is None:
                    if not self.outputs[i].finished:
                        raise engine_failure("the engine ended this request before it finished")
                    continue
                for ev in item:
                    yield ChoiceDelta(i, self._take(i, ev))
        finally:
            for t in tasks:
                t.cancel()
            self.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self) -> None:
        """Run every choice to its end (for a response that is not streamed)."""
        async with aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass

    def _take(self, i: int, ev: TokenEvent) -> OutputDelta:
        if ev.error is not None:
            raise engine_failure(ev.error)
        if ev.finish_reason is FinishReason.ABORT:
            raise engine_failure("the engine aborted this request")
        delta = self.outputs[i].add(ev)
        if delta.stop_string_hit:
            self._streams[i].stop()
        tracker = self._trackers[i]
        if tracker is not None:
            for _ in delta.token_ids:
                tracker.token()
            if delta.finish_reason is not None:
                tracker.finish(delta.finish_reason.value, ev.queue_time_s)
        return delta

    def close(self) -> None:
        """Cancel every unfinished choice (the engine aborts it) and count it as aborted."""
        for out, stream, tracker in zip(self.outputs, self._streams, self._trackers, strict=True):
            if not out.finished:
                if tracker is not None:
                    tracker.finish(FinishReason.ABORT.value)
                stream.cancel()


async def generates(engine: AsyncEngineClient, prompt_ids: list[int]) -> bool:
    """Whether the engine generates: one greedy one-token request through the same path
    as every other (a health probe; the request metrics do not count it)."""
    probe = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = await Generation.start(engine, [Job(0, prompt_ids, probe)], tokenizer=None)
    await gen.wait()
    return len(gen.outputs[0].token_ids) == 1


def _taken(submits: Sequence[asyncio.Future[EngineStream]]) -> list[EngineStream]:
    """The streams of the submissions that succeeded."""
    return [s.result() for s in submits if s.done() and not s.cancelled() and s.exception() is None]
