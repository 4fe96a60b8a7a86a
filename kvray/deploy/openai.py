"""The OpenAI endpoints' responses: choices running on an engine, formatted as the pydantic
response models of `protocol.py`.

Framework-free: `OpenAIServing` takes validated requests and returns a response model, or
for a stream an async iterator of chunk models; `api.py` serializes them at the HTTP edge
(JSON, or server-sent events). Turning a request into engine requests is `prepare.py`'s
job and running them `generation.py`'s; what is left here is the response bodies: text,
finish reasons, logprobs and usage, whole or chunk by chunk, and vLLM's extras on them:
`echo`, `return_token_ids` and `stream_options.continuous_usage_stats`.

A stream holds back what is not ready to show (part of a character, a possible stop
string, a tool call that may be starting); the logprobs and token ids of the tokens held
go out with the next chunk sent, so a stream carries every token, as the whole response
does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Generic, TypedDict, TypeVar

from pydantic import BaseModel

from kvray.core import FinishReason, RequestRejected, check_prompt
from kvray.deploy.generation import AsyncEngineClient, EngineLimits, Generation
from kvray.deploy.metrics import RequestMetrics
from kvray.deploy.prepare import Prepared, Preparer
from kvray.deploy.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    VersionResponse,
)
from kvray.deploy.protocol import FinishReason as ResponseFinish
from kvray.deploy.settings import ServeConfig, served_names
from kvray.deploy.tools import ReplyStream
from kvray.text import Logprob, OutputDelta, OutputState, encode
from kvray.text.token_bytes import TextOffsets, TokenBytes, token_text

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer

# A response never says "abort": an aborted request is an error (503) instead.
_FINISH: dict[FinishReason, ResponseFinish] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


class _Head(TypedDict):
    """The fields every response body of one request starts with."""

    id: str
    created: int
    model: str


Chunk = TypeVar("Chunk", bound=BaseModel, covariant=True)


class ChunkStream(Generic[Chunk]):
    """A streamed response: its chunks, and the choices behind them. `aclose()` ends the
    choices still running however far the stream got, even if it never started (a client
    that went away before the first chunk): the one way a stream's requests are aborted."""

    def __init__(self, chunks: AsyncGenerator[Chunk, None], generation: Generation) -> None:
        self._chunks = chunks
        self._generation = generation

    def __aiter__(self) -> AsyncGenerator[Chunk, None]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._generation.close()


def _finish(reason: FinishReason | None, called: bool = False) -> ResponseFinish | None:
    """The response's finish reason; a reply that chose to stop on tool calls says so (a
    forced named function is `stop`, as OpenAI and vLLM answer it)."""
    if called and reason is FinishReason.STOP:
        return "tool_calls"
    return None if reason is None else _FINISH[reason]


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        limits: EngineLimits,
        engine: AsyncEngineClient,
        metrics: RequestMetrics | None = None,
        policy: ServeConfig | None = None,
        aliases: Sequence[str] = (),
    ) -> None:
        self.model_name = model_name  # what responses name
        # every name a request may give: the model's, then its aliases
        self.model_names = served_names(model_name, aliases)
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.limits = limits
        self.engine = engine
        self.metrics = metrics
        self.prepare = Preparer(tokenizer, limits, policy or ServeConfig())
        if metrics is not None:
            self.prepare.grammar.on_compile = metrics.grammar_compile.observe

    def models(self) -> ModelList:
        """One card for each name the model is served under (as vLLM lists them)."""
        return ModelList(
            data=[
                ModelCard(
                    id=name, created=0, owned_by="kvray", max_model_len=self.limits.max_seq_len
                )
                for name in self.model_names
            ]
        )

    def model(self, model: str) -> ModelCard:
        """`GET /v1/models/{model}`: the card of that name, if the model is served under it,
        else 404."""
        self._check_model(model)
        return next(card for card in self.models().data if card.id == model)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = "', '".join(self.model_names)
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{served}'",
                "model",
                "NotFoundError",
            )

    async def _start(
        self, model: str | None, prepare: Callable[[], Prepared], constrained: bool = False
    ) -> tuple[Prepared, Generation]:
        """Check the model, prepare the request, and start its choices; the engine's
        rejection becomes the 400 naming the request's field. A `constrained` request is
        prepared on a thread: its grammar may compile (a first schema: up to seconds), and
        the event loop keeps every other stream of this ingress moving meanwhile."""
        self._check_model(model)
        prepared = await asyncio.to_thread(prepare) if constrained else prepare()
        if self.metrics is not None and prepared.constrained:
            self.metrics.constrained_requests.inc()
        try:
            if len(prepared.jobs) > 1:  # refused before any choice is taken and withdrawn
                checked: set[int] = set()
                for job in prepared.jobs:
                    if id(job.prompt_ids) not in checked:  # a prompt's n choices share its ids
                        checked.add(id(job.prompt_ids))
                        check_prompt(
                            job.prompt_ids,
                            job.sampling.max_tokens,
                            self.limits.max_seq_len,
                            self.limits.vocab_size,
                        )
            gen = await Generation.start(self.engine, prepared.jobs, self.tokenizer, self.metrics)
        except RequestRejected as e:
            raise prepared.rejected(e) from None
        return prepared, gen

    def _head(self, kind: str) -> _Head:
        return _Head(
            id=f"{kind}-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name
        )

    # -- vLLM's utility endpoints: /tokenize, /detokenize, /version -----------------------

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The ids a prompt becomes: a text as /v1/completions encodes it, a conversation
        as /v1/chat/completions prepares it (the same code: `Preparer.chat`). Not checked
        against the context: `max_model_len` says how much fits."""
        self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = list(self.prepare.chat(req.as_chat()).jobs[0].prompt_ids)
        else:
            ids = encode(self.tokenizer, req.prompt, req.add_special_tokens is not False)
        strs = None
        if req.return_token_strs:
            strs = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        return TokenizeResponse(
            count=len(ids), max_model_len=self.limits.max_seq_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids of this model's vocabulary (special tokens included)."""
        self._check_model(req.model)
        vocab = self.limits.vocab_size
        for i, tok in enumerate(req.tokens):
            if not 0 <= tok < vocab:
                raise APIError(
                    400,
                    f"tokens[{i}] is {tok}, not in this model's vocabulary [0, {vocab})",
                    "tokens",
                )
        try:
            text = self.tokenizer.decode(req.tokens)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own refusal
            raise APIError(400, f"tokens cannot be decoded: {e}", "tokens") from None
        assert isinstance(text, str)  # one sequence of ids: one text
        return DetokenizeResponse(prompt=text)

    def version(self) -> VersionResponse:
        from kvray import __version__

        return VersionResponse(version=__version__)

    # -- /v1/completions ---------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> Completion | ChunkStream[Completion]:
        prepared, gen = await self._start(
            req.model, lambda: self.prepare.completion(req), bool(req.constraints())
        )
        head = self._head("cmpl")
        if req.stream:
            return ChunkStream(self._completion_chunks(req, prepared, gen, head), gen)
        await gen.wait()
        choices = []
        for i, out in enumerate(gen.outputs):
            choice = self._completion_choice(req, i, out, self._offsets(req))
            if req.echo:
                choice.text = prepared.echoed(i) + choice.text
            if req.return_token_ids:
                choice.prompt_token_ids = list(prepared.jobs[i].prompt_ids)
                choice.token_ids = list(out.token_ids)
            choices.append(choice)
        return Completion(**head, choices=choices, usage=_usage(prepared, gen.outputs))

    def _offsets(self, req: CompletionRequest) -> TextOffsets:
        return TextOffsets(self.token_bytes, req.skip_special_tokens is not False)

    def _completion_choice(
        self,
        req: CompletionRequest,
        index: int,
        part: OutputState | OutputDelta,
        offsets: TextOffsets,
    ) -> CompletionChoice:
        """A choice whole (`part` its OutputState) or one chunk of it (an OutputDelta;
        `offsets` has counted the choice's tokens before it)."""
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._completion_logprobs(part.logprobs, offsets)
        finish = _finish(part.finish_reason)
        return CompletionChoice(
            index=index, text=part.text, logprobs=logprobs, finish_reason=finish
        )

    async def _completion_chunks(
        self, req: CompletionRequest, prepared: Prepared, gen: Generation, head: _Head
    ) -> AsyncGenerator[Completion, None]:
        # Where each choice's next token's text starts, over the tokens sent so far.
        offsets = [self._offsets(req) for _ in gen.outputs]
        # Each choice's tokens whose text is still held back (part of a character, a
        # possible stop string): they go out with the next chunk sent.
        held = [_Held() for _ in gen.outputs]
        started = [False] * len(gen.outputs)  # the choice's first chunk has gone out
        async with aclosing(gen.deltas()) as deltas:
            async for c in deltas:
                d, i = c.delta, c.index
                held[i].add(d)
                if not d.shows_something:
                    continue
                logprobs, token_ids = held[i].take()
                d = dataclasses.replace(d, logprobs=logprobs)
                choice = self._completion_choice(req, i, d, offsets[i])
                first, started[i] = not started[i], True
                if first and req.echo:  # as vLLM: the prompt comes with the first chunk
                    choice.text = prepared.echoed(i) + choice.text
                if req.return_token_ids:
                    if first:
                        choice.prompt_token_ids = list(prepared.jobs[i].prompt_ids)
                    choice.token_ids = token_ids
                usage = self._choice_usage(req, prepared, gen, i)
                yield Completion(**head, choices=[choice], usage=usage)
        if req.include_usage:
            yield Completion(**head, choices=[], usage=_usage(prepared, gen.outputs))

    @staticmethod
    def _choice_usage(
        req: CompletionRequest | ChatCompletionRequest,
        prepared: Prepared,
        gen: Generation,
        index: int,
    ) -> Usage | None:
        """A chunk's usage under continuous_usage_stats (else None): as vLLM counts it, its
        choice's prompt and the tokens that choice generated so far."""
        if not req.continuous_usage:
            return None
        prompt = len(prepared.jobs[index].prompt_ids)
        completion = len(gen.outputs[index].token_ids)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    # -- /v1/chat/completions ----------------------------------------------------------------

    async def chat(
        self, req: ChatCompletionRequest
    ) -> ChatCompletion | ChunkStream[ChatCompletionChunk]:
        prepared, gen = await self._start(
            req.model, lambda: self.prepare.chat(req), bool(req.constraints() or req.tools)
        )
        head = self._head("chatcmpl")
        if req.stream:
            return ChunkStream(self._chat_chunks(req, prepared, gen, head), gen)
        await gen.wait()
        choices = []
        chose = req.tool_mode != "named"  # the model chose to call tools, if it called any
        echoed = req.echoed()
        for i, out in enumerate(gen.outputs):
            assert out.finish_reason is not None
            content, calls = prepared.tools.reply(out.text, out.finish_reason)
            if echoed:  # as vLLM: the last message's content, then the reply's
                content = echoed + (content or "")
            message = AssistantMessage(content=content, tool_calls=calls or None)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._chat_logprobs(out.logprobs) if req.logprobs else None,
                    finish_reason=_finish(out.finish_reason, chose and bool(calls)),
                    token_ids=list(out.token_ids) if req.return_token_ids else None,
                )
            )
        prompt_ids = list(prepared.jobs[0].prompt_ids) if req.return_token_ids else None
        return ChatCompletion(
            **head,
            choices=choices,
            usage=_usage(prepared, gen.outputs),
            prompt_token_ids=prompt_ids,
        )

    async def _chat_chunks(
        self, req: ChatCompletionRequest, prepared: Prepared, gen: Generation, head: _Head
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        prompt_ids = list(prepared.jobs[0].prompt_ids) if req.return_token_ids else None
        for i in range(len(gen.outputs)):
            role = ChatDelta(role="assistant", content="")
            first = ChatChunkChoice(index=i, delta=role, logprobs=None, finish_reason=None)
            yield ChatCompletionChunk(
                **head,
                choices=[first],
                usage=self._choice_usage(req, prepared, gen, i),
                prompt_token_ids=prompt_ids,
            )
        echoed = req.echoed()
        for i in range(len(gen.outputs) if echoed else 0):  # as vLLM: after the roles
            repeat = ChatChunkChoice(
                index=i, delta=ChatDelta(content=echoed), logprobs=None, finish_reason=None
            )
            usage = self._choice_usage(req, prepared, gen, i)
            yield ChatCompletionChunk(**head, choices=[repeat], usage=usage)
        replies = [ReplyStream(prepared.tools) for _ in gen.outputs]
        chose = req.tool_mode != "named"  # as in chat()
        held = [_Held() for _ in gen.outputs]  # as in _completion_chunks
        async with aclosing(gen.deltas()) as deltas:
            async for c in deltas:
                d, i = c.delta, c.index
                held[i].add(d)
                if not d.shows_something:
                    continue
                reply = replies[i]
                text, calls = reply.push(d.text, d.finish_reason)
                if not (text or calls or d.finish_reason):
                    continue  # held back (a tool call may be starting)
                entries, token_ids = held[i].take()
                choice = ChatChunkChoice(
                    index=i,
                    delta=ChatDelta(content=text or None, tool_calls=calls or None),
                    logprobs=self._chat_logprobs(entries) if req.logprobs else None,
                    finish_reason=_finish(d.finish_reason, chose and reply.called),
                    token_ids=token_ids if req.return_token_ids else None,
                )
                usage = self._choice_usage(req, prepared, gen, i)
                yield ChatCompletionChunk(**head, choices=[choice], usage=usage)
        if req.include_usage:
            yield ChatCompletionChunk(**head, choices=[], usage=_usage(prepared, gen.outputs))

    # -- logprobs ----------------------------------------------------------------------------

    # A token is named by its own bytes (kvray/text/token_bytes.py), not by decoding it alone:
    # the tokens of a character split over several each keep their part of it.

    def _token_text(self, token_id: int) -> str:
        return token_text(self.token_bytes(token_id))

    def _chat_logprobs(self, entries: Sequence[Logprob]) -> ChatLogprobs:
        content = []
        for tok, lp, top in entries:
            raw = self.token_bytes(tok)
            tops = [
                TopLogprob(token=token_text(b), logprob=v, bytes=list(b))
                for b, v in ((self.token_bytes(i), v) for i, v in (top or ()))
            ]
            content.append(
                TokenLogprob(token=token_text(raw), logprob=lp, bytes=list(raw), top_logprobs=tops)
            )
        return ChatLogprobs(content=content)

    def _completion_logprobs(
        self, entries: Sequence[Logprob], offsets: TextOffsets
    ) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        out.text_offset = offsets.starts(tok for tok, _, _ in entries)
        for tok, lp, top in entries:
            out.tokens.append(self._token_text(tok))
            out.token_logprobs.append(lp)
            tops: dict[str, float] | None = None
            if top:
                tops = {}
                for i, v in top:  # best first; two ids of the same bytes keep the better
                    tops.setdefault(self._token_text(i), v)
            out.top_logprobs.append(tops)
        return out


class _Held:
    """One streamed choice's tokens not sent yet: their logprobs and ids."""

    def __init__(self) -> None:
        self.logprobs: list[Logprob] = []
        self.token_ids: list[int] = []

    def add(self, delta: OutputDelta) -> None:
        self.logprobs += delta.logprobs
        self.token_ids += delta.token_ids

    def take(self) -> tuple[tuple[Logprob, ...], list[int]]:
        """What goes out with the chunk being sent; nothing is held after."""
        out = (tuple(self.logprobs), self.token_ids)
        self.logprobs, self.token_ids = [], []
        return out


def _usage(prepared: Prepared, outputs: Sequence[OutputState]) -> Usage:
    prompt = sum(prepared.prompt_lens)
    completion = sum(len(out.token_ids) for out in outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
