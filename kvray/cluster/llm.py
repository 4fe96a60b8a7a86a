"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.cluster.local import LocalEngine
from kvray.cluster.spec import EngineSpec
from kvray.config import EngineConfig
from kvray.core import FinishReason, Req, RequestRejected, SamplingParams
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

    tp_size 1 runs in this process; larger TP sizes need the Ray engine.
    """

    def __init__(
        self,
        model: str | None = None,
        tp_size: int = 1,
        page_size: int = 16,
        cache: str = "radix",
        dtype: str = "auto",
        num_pages: int | None = None,
        max_running_reqs: int = 256,
        max_prefill_tokens: int = 2048,
        max_seq_len: int | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            tp_size=tp_size,
            page_size=page_size,
            cache_policy=cache,
            dtype=dtype,
            num_pages=num_pages,
            max_running_reqs=max_running_reqs,
            max_prefill_tokens=max_prefill_tokens,
            max_seq_len=max_seq_len,
            attention_backend=attention_backend,
            seed=seed,
        )
        if tp_size != 1:
            raise NotImplementedError(
                "tp_size > 1 runs on the Ray engine, which this build does not have yet"
            )
        self.spec = EngineSpec.resolve(self.config, progress=progress)
        self.tokenizer = load_tokenizer(self.spec.model_path)
        self.engine = LocalEngine(self.config, self.spec)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
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

        outputs: dict[int, CompletionOutput] = {}
        detoks: dict[int, IncrementalDetokenizer] = {}
        order: list[int] = []
        reqs: dict[int, Req] = {}
        try:
            for ids, sp in zip(prompt_ids, params, strict=True):
                rid = self.engine.add_request(ids, sp)
                reqs[rid] = self.engine.scheduler.reqs[rid]
                order.append(rid)
                outputs[rid] = CompletionOutput(prompt_token_ids=ids)
                detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids, sp.stop)
            live = set(order)
            while live:
                for ev in self.engine.step():
                    out = outputs[ev.rid]
                    detok = detoks[ev.rid]
                    if ev.token_id is not None:
                        out.token_ids.append(ev.token_id)
                        if ev.logprob is not None:
                            out.logprobs.append(ev.logprob)
                        detok.push(ev.token_id)
                        if detok.stopped and not ev.finished:
                            self.engine.abort(ev.rid, FinishReason.STOP)
                            out.finish_reason = FinishReason.STOP.value
                    if ev.finished and out.finish_reason is None:
                        out.finish_reason = ev.finish_reason.value  # type: ignore[union-attr]
                    if out.finish_reason is not None and ev.rid in live:
                        detok.flush()
                        out.text = detok.text
                        out.num_cached_tokens = reqs[ev.rid].num_cached_prompt
                        live.discard(ev.rid)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [outputs[rid] for rid in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the chat template to one conversation or a list of them and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt_ids(self.tokenizer, list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)
