"""The OpenAI protocol over an engine: requests in, completions / chat completions out.

Framework-free: `OpenAIServing` takes validated pydantic requests and returns either a
response dict or an async iterator of SSE lines; the FastAPI routes in `api.py` only glue
it to HTTP. Tokenization, the chat template, incremental detokenization and stop strings
happen here; the engine sees token ids only.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvray.cluster.llm import chat_prompt_ids
from kvray.core import RequestRejected, SamplingParams, TokenEvent, ended_on_stop_token
from kvray.deploy.metrics import RequestMetrics
from kvray.deploy.protocol import ChatCompletionRequest, CompletionRequest
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


@dataclass
class _Choice:
    """One generated sequence as it accumulates."""

    index: int
    prompt_len: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...] | None]] = field(
        default_factory=list
    )
    finish_reason: str | None = None


@dataclass
class _Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...] | None]]
    finish_reason: str | None


def _now() -> int:
    return int(time.time())


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        max_seq_len: int,
        vocab_size: int,
        engine: EngineClient,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.engine = engine
        self.metrics = metrics

    # -- /v1/models -------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvray",
            "max_model_len": self.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "NotFoundError",
            )

    # -- request preparation ------------------------------------------------------------------

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

    def _max_tokens(self, prompt_len: int, requested: int | None, field_name: str) -> int:
        if prompt_len >= self.max_seq_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this model's context is "
                f"{self.max_seq_len} tokens",
                field_name,
            )
        if requested is None:
            return self.max_seq_len - prompt_len
        if prompt_len + requested > self.max_seq_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens and max_tokens is {requested}: "
                f"{prompt_len + requested} exceeds this model's context of "
                f"{self.max_seq_len} tokens",
                "max_tokens",
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
            ignore_eos=req.ignore_eos,
            seed=seed,
            logprobs=logprobs,
        )

    # -- running choices -----------------------------------------------------------------------

    async def _run(self, index: int, ids: list[int], sp: SamplingParams) -> AsyncIterator[_Delta]:
        """One choice: submit, detokenize, cut at stop strings, observe metrics."""
        try:
            stream = await self.engine.generate(ids, sp)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None
        detok = IncrementalDetokenizer(self.tokenizer, ids, sp.stop)
        m = self.metrics
        start = last = time.monotonic()
        generated = 0
        finished = False
        try:
            async for batch in stream:
                for ev in batch:
                    if ev.error is not None:
                        raise APIError(503, ev.error, None, "ServiceUnavailableError")
                    text, toks, lps = "", [], []
                    if ev.token_id is not None:
                        toks.append(ev.token_id)
                        now = time.monotonic()
                        if m is not None:
                            (m.ttft if generated == 0 else m.itl).observe(now - last)
                        last = now
                        generated += 1
                        if not ended_on_stop_token(ev, sp):
                            text = detok.push(ev.token_id)
                        if ev.logprob is not None:
                            lps.append((ev.token_id, ev.logprob, ev.top_logprobs))
                    reason = ev.finish_reason.value if ev.finish_reason is not None else None
                    if detok.stopped:  # a stop string wins over length, as in vLLM
                        if reason is None:
                            await stream.abort("stop")
                        reason = "stop"
                    if reason is not None:
                        text += detok.flush()
                        finished = True
                        if m is not None:
                            m.e2e.observe(time.monotonic() - start)
                            m.prompt_len.observe(len(ids))
                            m.gen_len.observe(generated)
                            m.prompt_tokens.inc(len(ids))
                            m.generation_tokens.inc(generated)
                            if ev.queue_time_s is not None:
                                m.queue.observe(ev.queue_time_s)
                            m.success(reason)
                    yield _Delta(index, text, toks, lps, reason)
                    if finished:
                        return
        finally:
            if not finished:
                await stream.abort("abort")

    async def _merged(
        self, jobs: Sequence[tuple[int, list[int], SamplingParams]]
    ) -> AsyncIterator[_Delta]:
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

    def _chat_logprobs(self, entries: list[Any]) -> dict[str, Any]:
        content = []
        for tok, lp, top in entries:
            s = self._token_text(tok)
            content.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(i)),
                            "logprob": v,
                            "bytes": list(t.encode()),
                        }
                        for i, v in (top or ())
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, entries: list[Any], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lp, top in entries:
            s = self._token_text(tok)
            tokens.append(s)
            token_lps.append(lp)
            tops.append({self._token_text(i): v for i, v in top} if top else None)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    @staticmethod
    def _usage(choices: Sequence[_Choice], prompt_lens: Sequence[int]) -> dict[str, int]:
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # -- endpoints -------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self._check_model(req.model)
        prompts = [self._encode(p) for p in req.prompts()]
        k = req.logprobs
        jobs = []
        for p_idx, ids in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), req.max_tokens, "prompt")
            for j in range(req.n):
                jobs.append((p_idx * req.n + j, ids, self._sampling(req, max_tokens, j, k)))
        prompt_lens = [len(p) for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", _now()
        choices = [_Choice(i, len(ids)) for i, ids, _ in jobs]
        if req.stream:
            return self._completion_stream(req, jobs, choices, prompt_lens, rid, created)
        await self._collect(jobs, choices)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c.logprobs, 0) if k is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": self._usage(choices, prompt_lens),
        }

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self._check_model(req.model)
        try:
            ids = chat_prompt_ids(self.tokenizer, req.conversation())
        except RequestRejected as e:
            raise APIError(400, f"{e}; use /v1/completions", e.param) from None
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation shape
            raise APIError(
                400, f"the chat template rejected the messages: {e}", "messages"
            ) from None
        max_tokens = self._max_tokens(len(ids), req.requested_max_tokens(), "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        jobs = [(j, ids, self._sampling(req, max_tokens, j, k)) for j in range(req.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", _now()
        choices = [_Choice(j, len(ids)) for j in range(req.n)]
        if req.stream:
            return self._chat_stream(req, jobs, choices, [len(ids)], rid, created)
        await self._collect(jobs, choices)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.logprobs) if k is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": self._usage(choices, [len(ids)]),
        }

    async def _collect(
        self, jobs: Sequence[tuple[int, list[int], SamplingParams]], choices: list[_Choice]
    ) -> None:
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
        jobs: Any,
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
            chunk = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": d.index,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason,
                    }
                ],
            }
            yield _sse(chunk)
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(choices, prompt_lens),
                }
            )
        yield "data: [DONE]\n\n"

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        jobs: Any,
        choices: list[_Choice],
        prompt_lens: list[int],
        rid: str,
        created: int,
    ) -> AsyncIterator[str]:
        k = (req.top_logprobs or 0) if req.logprobs else None
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }
        for c in choices:
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        async for d in self._merged(jobs):
            c = choices[d.index]
            c.token_ids.extend(d.token_ids)
            if not d.text and d.finish_reason is None:
                continue
            delta = {"content": d.text} if d.text else {}
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": self._chat_logprobs(d.logprobs) if k is not None else None,
                            "finish_reason": d.finish_reason,
                        }
                    ],
                }
            )
        if req.stream_options and req.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(choices, prompt_lens)})
        yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
