"""OpenAI-compatible request and response bodies (pydantic), and the error body.

Requests accept what OpenAI clients send, and vLLM's extra fields; other unknown fields
are ignored (as vLLM does). Every field the OpenAI reference marks nullable accepts `null`,
which means its default (`docs/api.md` has the table). `max_tokens: null` keeps vLLM's
meaning instead: no limit from the client, so the server's default applies. Fields kvray
cannot honour (suffix, best_of != n, echo with logprobs, and the vLLM extras marked
`_Only`) are refused with a 400 naming the field, unless they hold the value that changes
nothing, rather than silently ignored.

Structured outputs come in every spelling vLLM accepts: `response_format` (OpenAI's
`json_object` and `json_schema`), the `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object`), and the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`; at most one of them per request. Chat requests also take
`tools`, `tool_choice` and `parallel_tool_calls`, and `tool` / assistant `tool_calls`
messages in the history (`tools.py` turns them into prompts, grammars and tool calls).

The response models are what the server sends: `openai.py` builds them, `api.py` serializes
them at the HTTP edge, and the published OpenAPI document (`openapi.py`) is generated from
these same classes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from kvray.core import MAX_LOGIT_BIAS, MAX_LOGPROBS
from kvray.text.prompt import join_text_parts

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = MAX_LOGPROBS
# Names chat_template_kwargs may not set: the renderer's own arguments and the variables the
# request fills from its other fields.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# -- plain-words checks shared by the request models --------------------------------------------


def json_kind(value: Any) -> str:
    """How a JSON value reads in an error message: `a string`, `an array`, `null`, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, HugeInt):
        return f"an integer of {value.digits} digits"
    if isinstance(value, int | float):
        return f"the number {value!r}" if isinstance(value, int) else _float_words(value)
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _float_words(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return f"the number {value!r}"


class HugeInt:
    """A JSON integer longer than Python converts (sys.get_int_max_str_digits): the parser
    hands this marker on instead of raising, so validation can name the field."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _well_formed(text: str) -> str:
    """Refuse lone UTF-16 surrogates (valid JSON escapes, but not Unicode text)."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(
                f"contains a lone UTF-16 surrogate (\\u{ord(ch):04x} at character {i}), "
                "which is not valid Unicode text; send well-formed text"
            )
    return text


# A JSON string that is real Unicode text.
Text = Annotated[str, AfterValidator(_well_formed)]


def _integral(v: Any) -> Any:
    """JSON has numbers, not ints: 3.0 is the integer 3 (as JSON Schema reads it)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# A JSON integer: an int or an integral number, never a boolean or a string.
Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _published(*alternatives: dict[str, Any]) -> dict[str, Any]:
    """The schema the OpenAPI document shows for a field that validators narrow further
    than its type: the alternatives it accepts, or null."""
    return {"anyOf": [*alternatives, {"type": "null"}]}


class _Only:
    """Field metadata for a vLLM extra that kvray does not implement and that would change
    the output: `null`, absent or one of `accepted` (the value that changes nothing) is
    taken; anything else is refused, naming the field, rather than silently ignored."""

    def __init__(self, *accepted: Any) -> None:
        self.accepted = accepted

    def _check(self, v: Any) -> Any:
        def same(a: Any) -> bool:  # as JSON values: 1 is 1.0, but true is not 1
            return v is a if isinstance(v, bool) or isinstance(a, bool) else v == a

        if v is None or any(same(a) for a in self.accepted):
            return v
        shown = " or ".join(json.dumps(a) for a in (*self.accepted, None))
        raise ValueError(f"not supported by kvray (send {shown}, or omit it); got {json_kind(v)}")

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return _published(*({"const": a} for a in self.accepted))


def _prompt_shape(v: Any) -> Any:
    """Accept exactly: a string, a list of strings, a list of token ids, or a list of
    token-id lists (each non-empty); say which rule a value breaks in plain words."""
    want = (
        "must be a string, an array of strings, an array of token ids (integers), or an "
        "array of token-id arrays"
    )

    def is_id(x: Any) -> bool:
        if isinstance(x, float):
            return x.is_integer()
        return isinstance(x, int | HugeInt) and not isinstance(x, bool)

    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError(f"{want}; got {json_kind(v)}")
    if not v:
        raise ValueError("must not be an empty array")
    if all(isinstance(x, str) for x in v) or all(is_id(x) for x in v):
        return v
    if all(isinstance(x, list) for x in v):
        for i, p in enumerate(v):
            if not p:
                raise ValueError(f"item {i} is an empty token-id array")
            for j, x in enumerate(p):
                if isinstance(x, list):
                    raise ValueError(f"{want}; got arrays nested more than 2 deep (item {i})")
                if not is_id(x):
                    raise ValueError(
                        f"item {i} must be an array of token ids (integers); item {i}[{j}] "
                        f"is {json_kind(x)}"
                    )
        return v
    kinds = sorted({_item_kind(x) for x in v})
    raise ValueError(f"{want}; got an array mixing {', '.join(kinds)}")


def _item_kind(x: Any) -> str:
    if isinstance(x, list):
        return "arrays"
    if isinstance(x, str):
        return "strings"
    if isinstance(x, int) and not isinstance(x, bool):
        return "integers"
    return {type(None): "nulls", bool: "booleans", float: "numbers", dict: "objects"}.get(
        type(x), type(x).__name__
    )


def _stop_shape(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    if isinstance(v, list):
        bad = next(s for s in v if not isinstance(s, str))
        raise ValueError(f"must be a string or an array of strings; an item is {json_kind(bad)}")
    raise ValueError(f"must be a string or an array of strings; got {json_kind(v)}")


PromptField = Annotated[
    Text | list[Text] | list[Int] | list[list[Int]], BeforeValidator(_prompt_shape)
]
StopField = Annotated[Text | list[Text] | None, BeforeValidator(_stop_shape)]


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


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorDetail(message=message, type=type_, param=param, code=code)
    ).model_dump()


# -- requests ---------------------------------------------------------------------------------


class _Request(BaseModel):
    """`null` for a field with a non-null default means that default (the OpenAI
    reference's meaning), except for the fields in `_null_is_a_value`. Values are taken
    as JSON types, not coerced: `true` is no number and `"1"` no integer."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _null_is_a_value: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (
                v is None
                and k in fields
                and not fields[k].is_required()
                and fields[k].default is not None
                and k not in cls._null_is_a_value
            )
        }


class StreamOptions(_Request):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = Field(
        default=False,
        description=(
            "vLLM extra: with include_usage, every chunk also carries its choice's usage so far"
        ),
    )


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputsField(_Request):
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    def given(self) -> dict[str, Any]:
        """The keys set, by their JSON names (`json_object` only when true)."""
        keys = self.model_dump(by_alias=True, exclude_none=True)
        if not keys.get("json_object", True):
            del keys["json_object"]
        return keys


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: Text
    arguments: Text  # a JSON object, as text


class ToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = Field(default=None, description="default: the served model")
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=100.0, description="default 1")
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, description="default 1")
    top_k: Int | None = Field(default=None, ge=-1, description="-1: off (vLLM extra)")
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0, description="vLLM extra")
    seed: Int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: StopField = Field(
        default=None,
        description=f"at most {MAX_STOP} strings",
        json_schema_extra=_published(
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
        ),
    )
    stop_token_ids: list[Int] | None = Field(default=None, description="vLLM extra")
    n: Int | None = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: StrictBool | None = Field(default=False, description="vLLM extra")
    include_stop_str_in_output: StrictBool | None = Field(default=False, description="vLLM extra")
    skip_special_tokens: StrictBool | None = Field(default=True, description="vLLM extra")
    min_tokens: Int | None = Field(
        default=None, ge=0, description="vLLM extra: EOS and stop_token_ids wait for this many"
    )
    repetition_penalty: StrictFloat | None = Field(
        default=None, gt=0.0, description="vLLM extra: > 1 discourages prompt and output tokens"
    )
    # vLLM extras kvray does not implement: only their neutral value.
    length_penalty: Annotated[Any, _Only(1)] = None
    use_beam_search: Annotated[Any, _Only(False)] = None
    prompt_logprobs: Annotated[Any, _Only()] = None
    allowed_token_ids: Annotated[Any, _Only([])] = None
    bad_words: Annotated[Any, _Only([])] = None
    logits_processors: Annotated[Any, _Only([])] = None
    truncate_prompt_tokens: Annotated[Any, _Only()] = None
    spaces_between_special_tokens: Annotated[Any, _Only(True)] = None
    return_tokens_as_token_ids: Annotated[Any, _Only(False)] = None
    priority: Annotated[Any, _Only(0)] = None
    cache_salt: Annotated[Any, _Only()] = None
    return_token_ids: StrictBool | None = Field(
        default=False,
        description="vLLM extra: the response also carries the prompt's and the choices' token ids",
    )
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = Field(
        default=None,
        description="token id -> bias in [-100, 100], added to the logit",
        json_schema_extra=_published(
            {
                "type": "object",
                "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
                "additionalProperties": {
                    "type": "number",
                    "minimum": -MAX_LOGIT_BIAS,
                    "maximum": MAX_LOGIT_BIAS,
                },
            }
        ),
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = Field(
        default=None, description="vLLM extra: exactly one of json, regex, choice, grammar"
    )
    guided_json: dict[str, Any] | Text | None = Field(default=None, description="vLLM extra")
    guided_regex: Text | None = Field(default=None, description="vLLM extra")
    guided_choice: list[Text] | None = Field(default=None, description="vLLM extra")
    guided_grammar: Text | None = Field(default=None, description="vLLM extra")

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """Every output constraint the request sets, as (field, vLLM `structured_outputs`
        keys); more than one is the caller's to refuse."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            found.append(("response_format", {"json": rf.json_schema.schema_ or {}}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.given()))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        return found

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"keys are token ids (decimal strings); got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-100, 100]; got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are supported, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> Any:
        if v is not None and "stream" in info.data and not info.data["stream"]:
            raise ValueError("only applies to a streamed response (send stream: true)")
        return v

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries usage (vLLM: continuous_usage_stats, with include_usage)."""
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={  # what `_echo` checks, published
            "if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
            "then": {"properties": {"logprobs": {"type": "null"}}},
        }
    )
    _null_is_a_value: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    prompt: PromptField | None = Field(
        description="null: generate from the start of a document (the model's BOS token)"
    )
    max_tokens: Int | None = Field(
        default=16, ge=1, description="null: up to the server's default (--max-tokens-default)"
    )
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool | None = Field(
        default=False, description="each choice's text begins with its prompt; not with logprobs"
    )
    suffix: Text | None = Field(
        default=None, json_schema_extra=_published({"type": "string", "maxLength": 0})
    )
    best_of: Int | None = Field(default=None, ge=1, description="only equal to n")
    add_special_tokens: StrictBool | None = Field(
        default=True, description="vLLM extra: the tokenizer's BOS (and such) around a prompt"
    )

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and info.data.get("logprobs") is not None:
            raise ValueError(
                "with logprobs, echo would also return the prompt tokens' logprobs, which "
                "kvray does not compute (send echo: false, or logprobs: null)"
            )
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by kvray (send an empty string or omit it)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if "n" not in info.data:
            return v  # n itself is invalid, and its error is the one to report
        n = info.data["n"] or 1
        if v is not None and v != n:
            raise ValueError(f"must equal n ({n}): kvray does not rank candidates, got {v}")
        return v

    def prompts(self) -> list[str | list[int]] | None:
        """The prompt field as a list of prompts (strings or token-id lists); None for a
        null prompt."""
        p = self.prompt
        if p is None:
            return None
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Request):
    type: Literal["text"]
    text: Text


def _content_shape(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError(f"must be a string or an array of text parts; got {json_kind(v)}")
    for i, part in enumerate(v):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object, not {json_kind(part)}")
        kind = part.get("type")
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) else json_kind(kind)
            raise ValueError(f"part {i} has type {shown}; kvray takes text parts only")
    return v


class ChatMessage(_Request):
    model_config = ConfigDict(
        json_schema_extra={  # what `_content_unless_assistant` checks, published
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Only an assistant's message may leave it out (a reply that was only tool calls).
    content: Annotated[Text | list[TextPart] | None, BeforeValidator(_content_shape)] = Field(
        default=None, validate_default=True
    )
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or text parts)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts(part.text for part in self.content)


def _continue_or_prompt(cls: Any, v: bool | None, info: ValidationInfo) -> bool | None:
    if v and info.data.get("add_generation_prompt", False):
        raise ValueError("needs add_generation_prompt: false (as in vLLM)")
    return v


def _template_variables(cls: Any, v: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(
            f"{', '.join(map(repr, taken))} cannot be set here (they are the request's own "
            "fields or the renderer's)"
        )
    return v


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(
        default=None, ge=1, description="null: up to the server's default"
    )
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extras for the chat template.
    add_generation_prompt: StrictBool | None = Field(
        default=True, description="vLLM extra: end the prompt with the assistant's header"
    )
    continue_final_message: StrictBool | None = Field(
        default=False, description="vLLM extra: the reply continues the last (assistant) message"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM extra: more variables for the chat template"
    )
    echo: StrictBool | None = Field(
        default=False,
        description="vLLM extra: the reply begins with the last message's content when that "
        "message is the assistant's",
    )
    add_special_tokens: Annotated[Any, _Only(False)] = None
    chat_template: Annotated[Any, _Only()] = None
    documents: Annotated[Any, _Only()] = None

    _continue_or_prompt = field_validator("continue_final_message")(_continue_or_prompt)
    _template_variables = field_validator("chat_template_kwargs")(_template_variables)

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        """vLLM replies in the last message's role when there is no generation prompt,
        and echo repeats that message; kvray always replies as the assistant."""
        messages = info.data.get("messages")
        if not v or not messages or "add_generation_prompt" not in info.data:
            return v  # messages or add_generation_prompt is invalid: its error is reported
        role = messages[-1].role
        if info.data["add_generation_prompt"] is False and role != "assistant":
            raise ValueError(
                f"with add_generation_prompt false, echo would repeat the last message in "
                f"its own role ({role}); kvray replies as the assistant only (send echo: "
                "false, or end the messages with an assistant message)"
            )
        return v

    def echoed(self) -> str:
        """What echo puts before each reply: the last message's content if it is the
        assistant's (the role of the reply), as vLLM does; text parts joined by newlines."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return last.text()

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return choice  # tools itself is invalid, and its error is the one to report
        names = [t.function.name for t in info.data["tools"] or ()]
        if choice not in (None, "none") and not names:
            shown = "a named function" if isinstance(choice, NamedToolChoice) else repr(choice)
            raise ValueError(f"{shown} needs tools (send tools, or tool_choice 'none')")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"names the function {choice.function.name!r}, which is not among tools "
                f"({', '.join(names)})"
            )
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if "logprobs" not in info.data:
            return v  # logprobs itself is invalid, and its error is the one to report
        if v and not info.data["logprobs"]:
            raise ValueError("needs logprobs: true")
        return v

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the client's limit or None, the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named: how the reply may call tools (OpenAI's
        default: auto when tools are given, else none)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if not self.tools:
            return "none"
        return choice or "auto"


class TokenizeCompletionRequest(_Request):
    """`POST /tokenize` of a text (vLLM's utility endpoint): its ids as /v1/completions
    prompts with them."""

    model: Text | None = Field(default=None, description="default: the served model")
    prompt: Text
    add_special_tokens: StrictBool | None = Field(
        default=True, description="the tokenizer's BOS (and such) around the text"
    )
    return_token_strs: StrictBool | None = Field(
        default=False, description="also answer each token's vocabulary entry (token_strs)"
    )


class TokenizeChatRequest(_Request):
    """`POST /tokenize` of a conversation (vLLM's utility endpoint): the ids
    /v1/chat/completions prompts with for the same messages, tools and template options."""

    model: Text | None = Field(default=None, description="default: the served model")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: StrictBool | None = Field(
        default=True, description="end the prompt with the assistant's header"
    )
    continue_final_message: StrictBool | None = Field(
        default=False, description="the reply continues the last (assistant) message"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="more variables for the chat template"
    )
    return_token_strs: StrictBool | None = Field(
        default=False, description="also answer each token's vocabulary entry (token_strs)"
    )
    add_special_tokens: Annotated[Any, _Only(False)] = None
    chat_template: Annotated[Any, _Only()] = None
    documents: Annotated[Any, _Only()] = None

    _continue_or_prompt = field_validator("continue_final_message")(_continue_or_prompt)
    _template_variables = field_validator("chat_template_kwargs")(_template_variables)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request whose prompt this is."""
        return ChatCompletionRequest(
            messages=self.messages,
            tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(_Request):
    """`POST /detokenize` (vLLM's utility endpoint): the text of token ids."""

    model: Text | None = Field(default=None, description="default: the served model")
    tokens: list[Int] = Field(description="token ids of this model's vocabulary")


# -- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _is_none(value: object) -> bool:
    return value is None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    # vLLM's return_token_ids: the choice's prompt (in a stream: its first chunk only)
    # and the tokens generated (in a stream: the chunk's own).
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class Completion(BaseModel):
    """A /v1/completions response, or (object the same) one event of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # as vLLM


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class ToolCallDelta(BaseModel):
    """One tool call's part of a chunk: the first carries its id, type and name, the
    next ones pieces of its arguments (OpenAI's streaming of tool calls)."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    """A chunk's change to the message: it leaves out the fields it does not carry."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # the chunk's own


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # return_token_ids: on each choice's first chunk (its role), as vLLM sends it
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
