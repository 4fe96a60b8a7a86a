"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.cluster.client import EngineClient
from kvray.cluster.engine_core import EngineFailed
from kvray.cluster.local import LocalEngine
from kvray.cluster.spec import EngineSpec
from kvray.config import VLLM_ENGINE_ARGS, VLLM_IGNORED_ARGS, EngineConfig
from kvray.core import FinishReason, SamplingParams, TokenEvent
from kvray.grammar import GrammarCompiler, compiler_for
from kvray.text import (
    Message,
    OutputState,
    chat_ids,
    encode,
    load_chat_template,
    load_tokenizer,
    text_messages,
)

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclass
class CompletionOutput:
    """One prompt's result: the generated tokens and their text.

    It is also read the way vLLM's `RequestOutput` is: `outputs` is the request's choices
    (`[self]`, unless SamplingParams.n asked for more), and code written for vLLM
    (`out.outputs[0].text`, `out.prompt`, `out.prompt_token_ids`, `out.finished`) runs
    unchanged."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)  # each token's, when asked for
    # With SamplingParams.logprobs > 0, each token's most likely alternatives (token id ->
    # logprob, the chosen token included, as in vLLM).
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt: str | None = None  # the prompt's text, when it was given as text
    index: int = 0  # (vLLM: the choice's index within its request)

    # With n > 1 choices (on the first one): all of them, this one first.
    choices: list[CompletionOutput] | None = field(default=None, repr=False, compare=False)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self.choices or [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The generated tokens' summed logprobs (None unless logprobs were asked for)."""
        return sum(self.logprobs) if self.logprobs else None


class LLM:
    """Offline batch generation. `model=None` serves the embedded SmolLM2-135M-Instruct.

    Every other keyword is an `EngineConfig` field (tp_size, dtype, device, page_size,
    cache_policy, num_pages, max_prefill_tokens, ...), validated there, or vLLM's name of
    one (tensor_parallel_size, max_model_len, max_num_seqs, max_num_batched_tokens,
    block_size, enable_prefix_caching; trust_remote_code, gpu_memory_utilization and
    enforce_eager change nothing here, with a warning). tp_size 1 runs in
    this process (unless `use_ray`) and never imports Ray; larger TP sizes start an
    `Engine` on Ray (joining `address` / RAY_ADDRESS, or a local cluster, dispatching steps
    through compiled graphs on GPUs and plain actor calls on CPU, unless `compiled` says
    which). Call `shutdown()` (or use the LLM as a context manager) to release a Ray
    engine's actors.

    `skip_tokenizer_init` loads no tokenizer (a checkpoint may have none, e.g. random
    weights built for a benchmark): prompts must then be token ids, outputs carry token ids
    only (empty text), and stop strings cannot be used.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        skip_tokenizer_init: bool = False,
        use_ray: bool | None = None,
        compiled: bool | None = None,
        address: str | None = None,
        progress: bool = True,
        **engine: Any,
    ) -> None:
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        self.config = EngineConfig(model=model, **_engine_args(engine))
        self.engine: EngineClient
        if use_ray or (use_ray is None and self.config.tp_size > 1):
            from kvray.cluster.engine import Engine

            ray_engine = Engine(self.config, compiled=compiled, address=address, progress=progress)
            self.engine, self.spec = ray_engine, ray_engine.spec
        else:
            self.spec = EngineSpec.resolve(self.config, progress=progress)
            self.engine = LocalEngine(self.config, self.spec)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.spec.model_path)
        self._closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release the engine (a Ray engine's actors; an in-process one's model and KV
        pool). The LLM cannot generate afterwards."""
        if self._closed:
            return
        self._closed = True
        self.engine.shutdown()
        del self.engine

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text (tokenized), token ids (Python or numpy integers), or
        a vLLM prompt dict."""
        if isinstance(prompt, Mapping):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise ValueError(
                    "a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids', "
                    f"got keys {sorted(prompt)}"
                )
            prompt = prompt[keys.pop()]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return encode(self.tokenizer, prompt)
        if not isinstance(prompt, Iterable) or isinstance(prompt, bytes):
            raise TypeError(f"a prompt is text, token ids or a prompt dict, not {prompt!r}")
        ids = list(prompt)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"prompt token ids must be integers; item {i} is {t!r}")
            ids[i] = int(t)
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order. A prompt is text, token ids or a vLLM
        prompt dict (`encode`); `prompts` is one of them or a list of them. A prompt whose
        params ask for `n` choices runs n requests (a seeded one's choice i with seed + i),
        and its result is its first choice, with all n in `outputs`. (`use_tqdm`, vLLM's
        progress bar, is accepted; there is none.)"""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        batch = [prompts] if _is_one_prompt(prompts) else list(prompts)  # type: ignore[arg-type]
        prompt_ids = [self.encode(p) for p in batch]
        if sampling_params is None:
            params = [self._default_params(len(ids)) for ids in prompt_ids]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_ids):
                raise ValueError(f"{len(params)} sampling params for {len(prompt_ids)} prompts")
        for sp in params:
            if sp.structured_outputs is not None:  # GrammarError before anything runs
                self.grammar_compiler().compile(sp.structured_outputs)
        choices = [_choices(sp) for sp in params]
        flat = self._run(
            [ids for ids, cs in zip(prompt_ids, choices, strict=True) for _ in cs],
            [c for cs in choices for c in cs],
        )
        texts = [_prompt_text(p) for p in batch]
        results: list[CompletionOutput] = []
        for ids, cs, text in zip(prompt_ids, choices, texts, strict=True):
            outs = [_completion(ids, state, text, i) for i, state in enumerate(flat[: len(cs)])]
            del flat[: len(cs)]
            if len(outs) > 1:
                outs[0].choices = outs
            results.append(outs[0])
        return results

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[OutputState]:
        """Run one engine request per prompt to its end; their outputs, in order."""
        states = [
            OutputState(ids, sp, self.tokenizer) for ids, sp in zip(prompt_ids, params, strict=True)
        ]
        live: dict[int, OutputState] = {}  # by request id, until finished
        try:
            for ids, sp, state in zip(prompt_ids, params, states, strict=True):
                live[self.engine.submit(ids, sp)] = state
            while live:
                for ev in self.engine.poll(sorted(live)):
                    out = live.get(ev.rid)
                    if out is not None and self._take(ev, out):
                        del live[ev.rid]
        except BaseException:
            for rid in live:
                self.engine.abort(rid)
            raise
        return states

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (vLLM's name for `tokenizer`); None without one."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no params: SamplingParams' defaults
        under the checkpoint's own (generation_config.json's temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens), as vLLM's."""
        return SamplingParams(**dict(self.spec.sampling_defaults))

    def _default_params(self, prompt_len: int) -> SamplingParams:
        """A call's params when it gives none: the checkpoint's, with its max_new_tokens
        (a default, not the caller's budget) cut to the room the prompt leaves in the
        context, as the server's default budget is, instead of refusing the prompt."""
        sp = self.get_default_sampling_params()
        room = self.spec.max_seq_len - prompt_len
        if sp.max_tokens is not None and 0 < room < sp.max_tokens:
            sp = dataclasses.replace(sp, max_tokens=room, min_tokens=min(sp.min_tokens, room))
        return sp

    def grammar_compiler(self) -> GrammarCompiler:
        """This process's grammar compiler for the model (the in-process worker shares it)."""
        return compiler_for(self.spec.model_path, self.spec.vocab_size)

    def _take(self, ev: TokenEvent, state: OutputState) -> bool:
        """Record one event of a live request; True once it has finished."""
        if ev.error is not None:
            raise EngineFailed(ev.error)
        if state.add(ev).stop_string_hit:  # end the request here; its last event completes it
            final = self.engine.abort(ev.rid, FinishReason.STOP)
            if final is not None:
                state.add(final)
        return state.finished

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        special_tokens_in_messages: bool = False,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the chat template to one conversation or a list of them and generate.
        A message's content is text or OpenAI's list of text parts. Special-token text
        typed in a message stays text (see `kvray.text.prompt`) unless
        `special_tokens_in_messages`. The keywords are vLLM's: the template's
        `add_generation_prompt`, `continue_final_message` (the reply carries on the last
        message), the `tools` it renders, `chat_template` (Jinja text, or a file holding
        it, instead of the tokenizer's), more variables in `chat_template_kwargs`."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        options = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if chat_template is not None:
            options["chat_template"] = load_chat_template(chat_template)
        prompts = [
            chat_ids(
                self.tokenizer,
                text_messages(c),  # type: ignore[arg-type]
                special_tokens_in_messages,
                tools,
                options,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)


def _is_one_prompt(prompts: object) -> bool:
    """Whether `generate`'s argument is a single prompt rather than a list of them."""
    if isinstance(prompts, str | Mapping):
        return True
    if isinstance(prompts, Sequence) or hasattr(prompts, "__array__"):  # (a numpy array)
        return len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)  # type: ignore[arg-type,index]
    return False


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt")  # type: ignore[assignment]
    return prompt if isinstance(prompt, str) else None


def _engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM`'s engine keywords with vLLM's names read as EngineConfig's (both names of one
    setting at once is an error); the ones that change nothing here warn."""
    out = dict(kwargs)
    for vllm_name, ours in VLLM_ENGINE_ARGS.items():
        if vllm_name in out:
            if ours in out:
                raise ValueError(f"{vllm_name} and {ours} name one setting: give one")
            out[ours] = out.pop(vllm_name)
    # None is vLLM's default ("the engine decides"): the same as not giving it.
    if (enable := out.pop("enable_prefix_caching", None)) is not None:
        policy = "radix" if enable else "naive"
        if out.setdefault("cache_policy", policy) != policy:
            raise ValueError(
                f"enable_prefix_caching contradicts cache_policy={out['cache_policy']!r}"
            )
    for name in VLLM_IGNORED_ARGS:
        if name in out:
            out.pop(name)
            warnings.warn(f"{name} changes nothing in kvray; ignored", stacklevel=3)
    return out


def _choices(sp: SamplingParams) -> list[SamplingParams]:
    """The engine requests of one prompt's `n` choices (as the server's: seed + i)."""
    if sp.n == 1:
        return [sp]
    return [
        dataclasses.replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + i) % 2**63)
        for i in range(sp.n)
    ]


def _completion(
    prompt_ids: list[int], state: OutputState, prompt: str | None, index: int = 0
) -> CompletionOutput:
    assert state.finish_reason is not None
    return CompletionOutput(
        index=index,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        token_ids=state.token_ids,
        text=state.text,
        finish_reason=state.finish_reason.value,
        logprobs=[lp for _, lp, _ in state.logprobs],
        top_logprobs=[{**dict(top), tok: lp} for tok, lp, top in state.logprobs if top],
        num_cached_tokens=state.num_cached_tokens,
    )
