"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.cluster.client import EngineClient
from kvray.cluster.engine_core import EngineFailed
from kvray.cluster.local import LocalEngine
from kvray.cluster.spec import EngineSpec
from kvray.config import EngineConfig
from kvray.core import (
    FinishReason,
    RequestRejected,
    SamplingParams,
    TokenEvent,
    ended_on_stop_token,
)
from kvray.detokenizer import IncrementalDetokenizer

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    """One prompt's result: the generated tokens and their text."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


def load_tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the
    assistant's reply. The template writes its own special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestRejected("this model's tokenizer has no chat template", "messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class LLM:
    """Offline batch generation. `model=None` serves the embedded SmolLM2-135M-Instruct.

    Every other keyword is an `EngineConfig` field (tp_size, dtype, device, page_size,
    cache_policy, num_pages, max_prefill_tokens, ...), validated there. tp_size 1 runs in
    this process (unless `use_ray`) and never imports Ray; larger TP sizes start an
    `Engine` on Ray (joining `address` / RAY_ADDRESS, or a local cluster, dispatching steps
    through compiled graphs unless `compiled=False`). Call `shutdown()` (or use the LLM as
    a context manager) to release a Ray engine's actors.

    `skip_tokenizer_init` loads no tokenizer (a checkpoint may have none, e.g. random
    weights built for a benchmark): prompts must then be token ids, outputs carry token ids
    only (empty text), and stop strings cannot be used.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        skip_tokenizer_init: bool = False,
        use_ray: bool | None = None,
        compiled: bool = True,
        address: str | None = None,
        progress: bool = True,
        **engine: Any,
    ) -> None:
        self.config = EngineConfig(model=model, **engine)
        self.engine: EngineClient
        if use_ray or (use_ray is None and self.config.tp_size > 1):
            from kvray.cluster.engine import Engine

            ray_engine = Engine(self.config, compiled=compiled, address=address, progress=progress)
            self.engine, self.spec = ray_engine, ray_engine.spec
        else:
            self.spec = EngineSpec.resolve(self.config, progress=progress)
            self.engine = LocalEngine(self.config, self.spec)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.spec.model_path)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_ids = [self.encode(p) for p in prompts]  # type: ignore[union-attr]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_ids):
                raise ValueError(f"{len(params)} sampling params for {len(prompt_ids)} prompts")

        if self.tokenizer is None and any(sp.stop for sp in params):
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        outputs: dict[int, CompletionOutput] = {}
        detoks: dict[int, IncrementalDetokenizer | None] = {}
        order: list[int] = []
        live: set[int] = set()
        params_of: dict[int, SamplingParams] = {}
        try:
            for ids, sp in zip(prompt_ids, params, strict=True):
                rid = self.engine.submit(ids, sp)
                order.append(rid)
                live.add(rid)
                outputs[rid] = CompletionOutput(prompt_token_ids=ids)
                params_of[rid] = sp
                detoks[rid] = (
                    None
                    if self.tokenizer is None
                    else IncrementalDetokenizer(self.tokenizer, ids, sp.stop)
                )
            while live:
                for ev in self.engine.poll(sorted(live)):
                    if ev.rid not in live:
                        continue
                    self._apply(ev, outputs[ev.rid], detoks[ev.rid], params_of[ev.rid])
                    if outputs[ev.rid].finish_reason is not None:
                        live.discard(ev.rid)
        except BaseException:
            for rid in live:
                self.engine.abort(rid)
            raise
        return [outputs[rid] for rid in order]

    def _apply(
        self,
        ev: TokenEvent,
        out: CompletionOutput,
        detok: IncrementalDetokenizer | None,
        sp: SamplingParams,
    ) -> None:
        """Record one event; `detok` is None without a tokenizer (token ids only)."""
        if ev.error is not None:
            raise EngineFailed(ev.error)
        final = ev if ev.finished else None
        if ev.token_id is not None:
            out.token_ids.append(ev.token_id)
            if ev.logprob is not None:
                out.logprobs.append(ev.logprob)
            if detok is not None and not ended_on_stop_token(ev, sp):
                detok.push(ev.token_id)
                if detok.stopped and final is None:  # a stop string: end the request here
                    final = self.engine.abort(ev.rid, FinishReason.STOP)
        if final is None:
            return
        # A stop string wins over length (the token that completed it may be the last one).
        stopped = detok is not None and detok.stopped
        out.finish_reason = FinishReason.STOP.value if stopped else final.finish_reason
        if detok is not None:
            detok.flush()
            out.text = detok.text
        out.num_cached_tokens = final.num_cached_tokens or 0

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the chat template to one conversation or a list of them and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt_ids(self.tokenizer, list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)
