"""Request preparation: a validated OpenAI request becomes the engine requests of its
choices (prompt ids and SamplingParams; `n` per prompt).

Only the server's own policy is applied here (`ServeConfig`'s max_tokens_default and
max_tokens_cap, and special_tokens_in_messages for chat).
Whether a prompt fits is checked by `kvray.core.check_prompt` against the engine's limits:
by the engine on every request, and by the server first on a request of several choices
(so none is taken and then withdrawn). Its RequestRejected names the engine's fields
(`prompt`, `max_tokens`), and `Prepared.rejected` turns it into the 400 that names the
request's own field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvray.core import RequestRejected, SamplingParams, StructuredOutputsParams
from kvray.deploy.generation import EngineLimits, Job
from kvray.deploy.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvray.deploy.settings import ServeConfig
from kvray.deploy.tools import ToolMode, template_renders_tools
from kvray.grammar import GrammarCompiler, GrammarError
from kvray.text import chat_ids, document_start_id, encode

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer


@dataclass(frozen=True)
class Prepared:
    """The engine requests of one API request, with what its response needs."""

    jobs: tuple[Job, ...]
    prompt_lens: tuple[int, ...]  # one per prompt (n choices share theirs), for usage
    fields: Mapping[str, str]  # the engine's field name -> the request's
    tools: ToolMode = ToolMode("none")  # how the reply may call tools (chat)
    # One per prompt, with echo (completions): the prompt's text, which each of its
    # choices' text begins with.
    echo_texts: tuple[str, ...] = ()

    @property
    def constrained(self) -> bool:
        return any(j.sampling.structured_outputs is not None for j in self.jobs)

    def echoed(self, choice: int) -> str:
        """The prompt text choice `choice` begins with ("" without echo)."""
        if not self.echo_texts:
            return ""
        return self.echo_texts[choice // (len(self.jobs) // len(self.echo_texts))]

    def rejected(self, e: RequestRejected) -> APIError:
        """The engine's rejection as a 400 naming the request's field. The engine calls
        the token budget `max_tokens`; the message says what the client sent."""
        param = self.fields.get(e.param or "", e.param)
        message = str(e)
        if e.param == "max_tokens" and param is not None:
            message = message.replace("max_tokens", param)
        return APIError(400, message, param)


class Preparer:
    def __init__(self, tokenizer: Tokenizer, engine: EngineLimits, policy: ServeConfig) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.policy = policy
        self._document_start = document_start_id(tokenizer)
        # What a request leaves unset defaults to: the checkpoint's settings, or OpenAI's.
        self.defaults: dict[str, float | int] = (
            dict(engine.sampling_defaults) if policy.generation_config == "auto" else {}
        )
        self._grammar: GrammarCompiler | None = None

    @property
    def grammar(self) -> GrammarCompiler:
        """This server's grammar compiler: it checks every constrained request before the
        engine sees it (and warms nothing else: each engine worker compiles its own)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, self.engine.vocab_size)
        return self._grammar

    def _structured(
        self, req: CompletionRequest | ChatCompletionRequest, tools: ToolMode
    ) -> StructuredOutputsParams | None:
        """The request's output constraint (at most one), compiled once here so that a
        spec the grammar backend refuses is a 400 naming its field."""
        found = req.constraints()
        forced = tools.structured_outputs()
        if forced is not None:
            found.append(("tool_choice", {}))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise APIError(
                400, f"set at most one output constraint; this request sets {names}", found[1][0]
            )
        if not found:
            return None
        field, given = found[0]
        try:
            params = forced or StructuredOutputsParams(**given)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{field}: {e}", field) from None
        try:
            self.grammar.compile(params)
        except GrammarError as e:
            what = "the tools' parameters" if field == "tool_choice" else field
            raise APIError(400, f"{what} cannot be compiled into a grammar: {e}", field) from None
        return params

    def document_start(self) -> list[int]:
        """What a null prompt means: the start of a document (`text.document_start_id`)."""
        if self._document_start is None:
            raise APIError(
                400, "this model has no start-of-document token: send a prompt", "prompt"
            )
        return [self._document_start]

    def _check_bias(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        vocab = self.engine.vocab_size
        for key in req.logit_bias or ():
            if vocab is not None and int(key) >= vocab:
                raise APIError(
                    400,
                    f"logit_bias: token id {key} is not in this model's vocabulary [0, {vocab})",
                    "logit_bias",
                )

    def completion(self, req: CompletionRequest) -> Prepared:
        self._check_bias(req)
        structured = self._structured(req, ToolMode("none"))
        given = req.prompts()
        if given is None:
            prompts = [self.document_start()]
        else:
            special = req.add_special_tokens is not False
            prompts = [
                encode(self.tokenizer, p, special) if isinstance(p, str) else p for p in given
            ]
        n, jobs = req.num_choices, list[Job]()
        for p, ids in enumerate(prompts):
            max_tokens = self._budget(len(ids), req.max_tokens, "max_tokens")
            asked = None if req.max_tokens is None else "max_tokens"
            jobs += [
                Job(
                    p * n + j,
                    ids,
                    _sampling(req, max_tokens, j, req.logprobs, structured, self.defaults, asked),
                )
                for j in range(n)
            ]
        fields = {"prompt": "prompt", "max_tokens": "max_tokens"}
        echo_texts: tuple[str, ...] = ()
        if req.echo:
            echo_texts = tuple(self._prompt_text(p) for p in given or [[]])
        return Prepared(tuple(jobs), tuple(len(p) for p in prompts), fields, echo_texts=echo_texts)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt's text for echo: a text prompt as sent, a token-id prompt decoded
        (special tokens included, as vLLM decodes it); a null prompt has none."""
        if isinstance(prompt, str):
            return prompt
        if not prompt or not all(0 <= t < self.engine.vocab_size for t in prompt):
            return ""  # none, or ids the engine refuses (a 400 naming the prompt follows)
        text = self.tokenizer.decode(prompt)
        assert isinstance(text, str)
        return text

    def chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_bias(req)
        tools = ToolMode.of(req)
        structured = self._structured(req, tools)
        native = template_renders_tools(getattr(self.tokenizer, "chat_template", None))
        try:
            ids = chat_ids(
                self.tokenizer,
                tools.messages(req.messages, native),
                self.policy.special_tokens_in_messages,
                tools.template_tools() if native and tools.calls_tools else None,
                {
                    **(req.chat_template_kwargs or {}),
                    "add_generation_prompt": req.add_generation_prompt is not False,
                    "continue_final_message": bool(req.continue_final_message),
                },
            )
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation shape
            raise APIError(
                400, f"this model's chat template refused the messages: {e}", "messages"
            ) from None
        requested, field = req.requested_max_tokens()
        max_tokens = self._budget(len(ids), requested, field)
        asked = None if requested is None else field
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        jobs = tuple(
            Job(j, ids, _sampling(req, max_tokens, j, logprobs, structured, self.defaults, asked))
            for j in range(req.num_choices)
        )
        fields = {"prompt": "messages", "max_tokens": field}
        return Prepared(jobs, (len(ids),), fields, tools)

    def _budget(self, prompt_len: int, requested: int | None, field: str) -> int:
        """The max_tokens to ask the engine for: what the request asked (within the
        server's cap), or, when it set none, the server's default bounded by the rest of
        the context. At least 1: a prompt that leaves no room is the engine's to reject."""
        cap, default = self.policy.max_tokens_cap, self.policy.max_tokens_default
        if requested is None:
            room = self.engine.max_seq_len - prompt_len
            model = self.defaults.get("max_tokens")  # the checkpoint's max_new_tokens
            return max(1, int(min(x for x in (room, default, cap, model) if x is not None)))
        if cap is not None and requested > cap:
            message = f"{field} is {requested}; this server allows at most {cap} tokens per request"
            raise APIError(400, message, field)
        return requested


def _sampling(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    choice: int,
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
    defaults: Mapping[str, float | int],
    asked: str | None,
) -> SamplingParams:
    """`asked`: the field that set the request's budget `max_tokens`; None when the
    request set none (the budget is then the server's default)."""

    def given(name: str, value: float | int | None, openai: float | int) -> Any:
        """The request's value, else the checkpoint's default, else OpenAI's."""
        return value if value is not None else defaults.get(name, openai)

    # n choices of one seeded request differ from each other, and each is reproducible.
    seed = None if req.seed is None else (req.seed + choice) % (2**63)
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        budget = (
            f"{asked} ({max_tokens})"
            if asked is not None
            else f"this request's budget of {max_tokens} tokens (it set no max_tokens: the "
            "rest of the context, within the server's and the checkpoint's default budgets)"
        )
        raise APIError(400, f"min_tokens is {min_tokens}, more than {budget}", "min_tokens")
    return SamplingParams(
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        min_tokens=min_tokens,
        repetition_penalty=given("repetition_penalty", req.repetition_penalty, 1.0),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        temperature=given("temperature", req.temperature, 1.0),
        top_p=given("top_p", req.top_p, 1.0),
        top_k=given("top_k", req.top_k, -1),
        min_p=given("min_p", req.min_p, 0.0),
        max_tokens=max_tokens,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        seed=seed,
        logprobs=logprobs,
        structured_outputs=structured,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
    )
