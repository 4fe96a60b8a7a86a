"""The OpenAI protocol over an engine: requests in, completions / chat completions out.

Framework-free: `OpenAIServing` takes validated pydantic requests and returns either a
response dict or an async iterator of SSE lines; the FastAPI routes in `api.py` only glue
it to HTTP. Tokenization, the chat template, incremental detokenization and stop strings
happen here; the engine sees token ids only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from kvray.core import (
    FinishReason,
    RequestRejected,
    SamplingParams,
    TokenEvent,
    ended_on_stop_token,
)
from kvray.deploy.chat import chat_ids
from kvray.deploy.metrics import RequestMetrics
from kvray.deploy.protocol import (
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
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvray.detokenizer import IncrementalDetokenizer


class APIError(Exception):
    """An error with its HTTP status and OpenAI error body fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_


class EngineStream(Protocol):
    """One request's events; `abort(reason)` ends it early (a stop string, a disconnect)."""

    def __aiter__(self) -> AsyncIterator[list[TokenEvent]]: ...

    async def abort(self, reason: str) -> None: ...


class EngineClient(Protocol):
    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> EngineStream:
        """Submit a request (raises RequestRejected) and return its event stream."""
        ...


_Logprob = tuple[int, float, tuple[tuple[int, float], ...] | None]
_Job = tuple[int, list[int], SamplingParams]


@dataclass
class _Choice:
    """One generated sequence as it accumulates."""

    index: int
    prompt_len: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[_Logprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[_Logprob]
    finish_reason: str | None


def _now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class ServingLimits:
    """Server-side policy for what requests may ask.

    `max_tokens_default`: the limit when a request sets none (`max_tokens` null, or
    omitted on chat); None = the rest of the context, as vLLM. `max_tokens_cap`: the most
    any request may ask for (more is a 400). `special_tokens_in_messages`: tokenize chat
    content the plain way, so typed special-token text becomes special tokens (vLLM's
    default; off here, see `chat.py`)."""

    max_tokens_default: int | None = None
    max_tokens_cap: int | None = None
    special_tokens_in_messages: bool = False


def _engine_failure(e: BaseException) -> APIError:
    return APIError(
        503,
        f"the engine failed while serving this request ({type(e).__name__}); retry shortly",
        None,
        "ServiceUnavailableError",
    )


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        max_seq_len: int,
        vocab_size: int,
        engine: EngineClient,
        metrics: RequestMetrics | None = None,
        limits: ServingLimits | None = None,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or ServingLimits()

    # -- /v1/models -------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        card = ModelCard(
            id=self.model_name, created=0, owned_by="kvray", max_model_len=self.max_seq_len
        )
        return ModelList(data=[card]).model_dump()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "NotFoundError",
            )

    # -- request preparation ------------------------------------------------------------------

    @functools.cached_property
    def _document_start(self) -> int | None:
        tok = self.tokenizer
        vocab = tok.get_vocab()
        for candidate in ("<|endoftext|>", tok.bos_token, tok.eos_token):
            if candidate is not None and candidate in vocab:
                return int(vocab[candidate])
        return None

    def document_start_id(self) -> int:
        """What a null prompt means: the reference's `<|endoftext|>` (the document
        separator) where the vocabulary has it, else the BOS token, else EOS."""
        if self._document_start is None:
            raise APIError(
                400, "this model has no start-of-document token: send a prompt", "prompt"
            )
        return self._document_start

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = list(prompt)
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    raise APIError(
                        400,
                        f"token id {t} is outside the vocabulary [0, {self.vocab_size})",
                        "prompt",
                    )
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    def _max_tokens(
        self, prompt_len: int, requested: int | None, prompt_field: str, field_name: str
    ) -> int:
        """The request's token budget: what it asked for (checked against the cap and the
        context), or the server's default bounded by the context."""
        room = self.max_seq_len - prompt_len
        if room <= 0:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this model's context is "
                f"{self.max_seq_len} tokens",
                prompt_field,
            )
        cap, default = self.limits.max_tokens_cap, self.limits.max_tokens_default
        if requested is None:
            return min(x for x in (room, default, cap) if x is not None)
        if cap is not None and requested > cap:
            raise APIError(
                400,
                f"{field_name} is {requested}; this server allows at most {cap} tokens per request",
                field_name,
            )
        if requested > room:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens and {field_name} is {requested}: "
                f"{prompt_len + requested} exceeds this model's context of "
                f"{self.max_seq_len} tokens",
                field_name,
            )
        return requested

    @staticmethod
    def _sampling(
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        choice: int,
        logprobs: int | None,
    ) -> SamplingParams:
        # n choices of one seeded request differ from each other, and each is reproducible.
        seed = None if req.seed is None else (req.seed + choice) % (2**63)
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens,
            stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            seed=seed,
            logprobs=logprobs,
        )

    # -- running choices -----------------------------------------------------------------------

    async def _submit(self, ids: list[int], sp: SamplingParams) -> EngineStream:
        try:
            return await self.engine.generate(ids, sp)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - no engine could take it: a 503, not a 500
            raise _engine_failure(e) from None

    @staticmethod
    async def _events(stream: EngineStream) -> AsyncIterator[list[TokenEvent]]:
        """The stream's event batches; an engine that dies mid-stream is a 503."""
        it = stream.__aiter__()
        while True:
            try:
                batch = await it.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:  # noqa: BLE001 - the actor or replica went away
                raise _engine_failure(e) from None
            yield batch

    async def _run(self, index: int, ids: list[int], sp: SamplingParams) -> AsyncIterator[_Delta]:
        """One choice: submit, detokenize, cut at stop strings, observe metrics."""
        stream = await self._submit(ids, sp)
        detok = IncrementalDetokenizer(self.tokenizer, ids, sp.stop)
        tracker = self.metrics.track(len(ids)) if self.metrics is not None else None
        finished = False
        try:
            async for batch in self._events(stream):
                for ev in batch:
                    if ev.error is not None:
                        raise APIError(503, ev.error, None, "ServiceUnavailableError")
                    if ev.finish_reason is FinishReason.ABORT:
                        raise APIError(
                            503, "the engine aborted this request", None, "ServiceUnavailableError"
                        )
                    text, toks, lps = "", [], []
                    if ev.token_id is not None:
                        toks.append(ev.token_id)
                        if tracker is not None:
                            tracker.token()
                        if not ended_on_stop_token(ev, sp):
                            text = detok.push(ev.token_id)
                        if ev.logprob is not None:
                            lps.append((ev.token_id, ev.logprob, ev.top_logprobs))
                    reason = ev.finish_reason.value if ev.finish_reason is not None else None
                    if detok.stopped and reason is None:  # a stop string wins over length
                        await stream.abort("stop")
                        reason = "stop"
                    if reason is not None:
                        text += detok.flush()
                        if detok.stopped:
                            reason = "stop"
                        finished = True
                        if tracker is not None:
                            tracker.finish(reason, ev.queue_time_s)
                    yield _Delta(index, text, toks, lps, reason)
                    if finished:
                        return
        finally:
            if not finished:
                if tracker is not None:
                    tracker.finish("abort")
                await stream.abort("abort")

    async def _merged(self, jobs: Sequence[_Job]) -> AsyncIterator[_Delta]:
        """Run every choice concurrently; yield their deltas as they come."""
        queue: asyncio.Queue[_Delta | BaseException | None] = asyncio.Queue()

        async def pump(index: int, ids: list[int], sp: SamplingParams) -> None:
            try:
                async for d in self._run(index, ids, sp):
                    queue.put_nowait(d)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(e)
                return
            queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(*job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- formatting ------------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, entries: list[_Logprob]) -> ChatLogprobs:
        content = []
        for tok, lp, top in entries:
            s = self._token_text(tok)
            tops = [
                TopLogprob(token=(t := self._token_text(i)), logprob=v, bytes=list(t.encode()))
                for i, v in (top or ())
            ]
            content.append(
                TokenLogprob(token=s, logprob=lp, bytes=list(s.encode()), top_logprobs=tops)
            )
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, entries: list[_Logprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tok, lp, top in entries:
            s = self._token_text(tok)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({self._token_text(i): v for i, v in top} if top else None)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    @staticmethod
    def _usage(choices: Sequence[_Choice], prompt_lens: Sequence[int]) -> Usage:
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for c in choices)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    # -- endpoints -------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self._check_model(req.model)
        given = req.prompts()
        prompts = (
            [[self.document_start_id()]] if given is None else [self._encode(p) for p in given]
        )
        k, n = req.logprobs, req.num_choices
        jobs: list[_Job] = []
        for p_idx, ids in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), req.max_tokens, "prompt", "max_tokens")
            for j in range(n):
                jobs.append((p_idx * n + j, ids, self._sampling(req, max_tokens, j, k)))
        prompt_lens = [len(p) for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", _now()
        choices = [_Choice(i, len(ids)) for i, ids, _ in jobs]
        if req.stream:
            return self._completion_stream(req, jobs, choices, prompt_lens, rid, created)
        await self._collect(jobs, choices)
        return Completion(
            id=rid,
            created=created,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=self._completion_logprobs(c.logprobs, 0) if k is not None else None,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                )
                for c in choices
            ],
            usage=self._usage(choices, prompt_lens),
        ).model_dump()

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self._check_model(req.model)
        try:
            ids = chat_ids(
                self.tokenizer, req.conversation(), self.limits.special_tokens_in_messages
            )
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation shape
            raise APIError(
                400, f"this model's chat template refused the messages: {e}", "messages"
            ) from None
        requested, field_name = req.requested_max_tokens()
        max_tokens = self._max_tokens(len(ids), requested, "messages", field_name)
        k = (req.top_logprobs or 0) if req.logprobs else None
        n = req.num_choices
        jobs: list[_Job] = [(j, ids, self._sampling(req, max_tokens, j, k)) for j in range(n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", _now()
        choices = [_Choice(j, len(ids)) for j in range(n)]
        if req.stream:
            return self._chat_stream(req, jobs, choices, [len(ids)], rid, created)
        await self._collect(jobs, choices)
        return ChatCompletion(
            id=rid,
            created=created,
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=self._chat_logprobs(c.logprobs) if k is not None else None,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                )
                for c in choices
            ],
            usage=self._usage(choices, [len(ids)]),
        ).model_dump()

    async def _collect(self, jobs: Sequence[_Job], choices: list[_Choice]) -> None:
        async for d in self._merged(jobs):
            c = choices[d.index]
            c.text += d.text
            c.logprobs.extend(d.logprobs)
            c.token_ids.extend(d.token_ids)
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason

    async def _completion_stream(
        self,
        req: CompletionRequest,
        jobs: Sequence[_Job],
        choices: list[_Choice],
        prompt_lens: list[int],
        rid: str,
        created: int,
    ) -> AsyncIterator[str]:
        k = req.logprobs
        offsets = [0] * len(choices)
        async for d in self._merged(jobs):
            c = choices[d.index]
            c.token_ids.extend(d.token_ids)
            if not d.text and d.finish_reason is None:
                continue
            lp = None
            if k is not None:
                lp = self._completion_logprobs(d.logprobs, offsets[d.index])
                offsets[d.index] += len(d.text)
            choice = CompletionChoice(
                index=d.index,
                text=d.text,
                logprobs=lp,
                finish_reason=d.finish_reason,  # type: ignore[arg-type]
            )
            yield _sse(Completion(id=rid, created=created, model=self.model_name, choices=[choice]))
        if req.include_usage:
            usage = self._usage(choices, prompt_lens)
            yield _sse(
                Completion(id=rid, created=created, model=self.model_name, choices=[], usage=usage)
            )
        yield "data: [DONE]\n\n"

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        jobs: Sequence[_Job],
        choices: list[_Choice],
        prompt_lens: list[int],
        rid: str,
        created: int,
    ) -> AsyncIterator[str]:
        k = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(*items: ChatChunkChoice, usage: Usage | None = None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=rid, created=created, model=self.model_name, choices=list(items), usage=usage
                )
            )

        for c in choices:
            first = ChatDelta(role="assistant", content="")
            yield chunk(
                ChatChunkChoice(index=c.index, delta=first, logprobs=None, finish_reason=None)
            )
        async for d in self._merged(jobs):
            c = choices[d.index]
            c.token_ids.extend(d.token_ids)
            if not d.text and d.finish_reason is None:
                continue
            yield chunk(
                ChatChunkChoice(
                    index=d.index,
                    delta=ChatDelta(content=d.text or None),
                    logprobs=self._chat_logprobs(d.logprobs) if k is not None else None,
                    finish_reason=d.finish_reason,  # type: ignore[arg-type]
                )
            )
        if req.include_usage:
            yield chunk(usage=self._usage(choices, prompt_lens))
        yield "data: [DONE]\n\n"


def _sse(event: BaseModel) -> str:
    """One server-sent event. A chat delta leaves out the fields it does not carry."""
    body = event.model_dump()
    for choice in body.get("choices", ()):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
