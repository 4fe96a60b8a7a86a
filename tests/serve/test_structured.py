"""Structured outputs and tool calling over real HTTP (the package's shared Serve app on the
embedded SmolLM2, the official openai client, LangChain's ChatOpenAI): every constrained
reply parses and validates against its schema, greedy and seeded, streamed and not, n > 1;
regex and choice replies match; forced tool calls carry valid arguments; a tool result
goes back through the chat template; a spec the grammar backend refuses is a 400 naming
its field. After each test the engine's page accounting balances."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .serve_helpers import MODEL, assert_engine_clean, metrics, sample

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]

PERSON = {
    "type": "object",
    "properties": {
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
        "colors": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["person", "colors"],
}
TICKET = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "level": {"enum": ["low", "mid", "high"]},
        "open": {"type": "boolean"},
    },
    "required": ["code", "score", "level", "open"],
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["id"],
    },
    "minItems": 1,
    "maxItems": 3,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person and their favourite colors as JSON."}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(autouse=True)
def clean_engine(server: str) -> Iterator[None]:
    yield
    assert_engine_clean()


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, TICKET, ITEMS], ids=["nested", "bounds", "array"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_replies_validate(
    client: openai.OpenAI, schema: dict[str, Any], stream: bool
) -> None:
    """Greedy whole, and two seeded samples at temperature 1 streamed."""
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, response_format=_format(schema))
    if stream:
        chunks = client.chat.completions.create(
            **kw, temperature=1.0, seed=7, n=2, max_tokens=80, stream=True
        )
        texts, finish = ["", ""], [None, None]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
                finish[ch.index] = ch.finish_reason or finish[ch.index]
    else:
        r = client.chat.completions.create(**kw, temperature=0, max_tokens=80)
        texts = [r.choices[0].message.content]
        finish = [r.choices[0].finish_reason]
    for text, reason in zip(texts, finish, strict=True):
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_completions_endpoint(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with a JSON object that has the key "name".'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(
        model=MODEL,
        prompt="A ticket:",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"response_format": _format(TICKET)},
    )
    for choice in c.choices:
        jsonschema.validate(json.loads(choice.text), TICKET)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_regex": r"[0-9]{3}-[0-9]{4}"},
        {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
        {"guided_choice": ["yes", "no", "maybe"]},
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    ],
    ids=["guided_regex", "regex", "guided_choice", "choice"],
)
def test_regex_and_choice(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=16, temperature=1.0, seed=1, n=2, extra_body=extra
    )
    spec = extra.get("structured_outputs", extra)
    for choice in r.choices:
        if "regex" in spec or "guided_regex" in spec:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", choice.text), choice.text
        else:
            assert choice.text in ("yes", "no", "maybe"), choice.text
        assert choice.finish_reason == "stop"


def test_grammar_lark_and_ebnf(client: openai.OpenAI) -> None:
    for grammar in ('root ::= "cat" | "dog"', 'start: "cat" | "dog"'):
        r = client.completions.create(
            model=MODEL,
            prompt="A pet:",
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        assert r.choices[0].text in ("cat", "dog")


def _args_valid(call: Any, tool: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_choice_required_then_tool_result(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _args_valid(call, WEATHER)
    # The call and its result go back through the chat template; the model answers.
    history = [
        *PARIS,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=24
    )
    assert r2.choices[0].message.content
    assert r2.choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_streams_argument_deltas(client: openai.OpenAI) -> None:
    forced: dict[str, Any] = dict(
        model=MODEL,
        messages=PARIS,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
    )
    chunks = list(
        client.chat.completions.create(**forced, temperature=1.0, seed=5, n=2, stream=True)
    )
    for index in (0, 1):
        deltas = [
            d
            for c in chunks
            for ch in c.choices
            if ch.index == index
            for d in ch.delta.tool_calls or ()
        ]
        assert deltas[0].id and deltas[0].function.name == "get_time"
        args = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(args), TIME["function"]["parameters"])
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.index == index]
        assert finish[-1] == "stop"  # forced, not chosen: OpenAI and vLLM say stop
    whole = client.chat.completions.create(**forced, temperature=0)
    (call,) = whole.choices[0].message.tool_calls
    _args_valid(call, TIME)
    assert whole.choices[0].finish_reason == "stop"


def test_refused_specs_are_400_naming_the_field(http: httpx.Client) -> None:
    cases = [
        ({"response_format": _format({"type": "object", "properties": 3})}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": PARIS, "max_tokens": 4, **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    assert http.get("/health").status_code == 200


def test_metrics_count_constrained_requests_and_compiles(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    before = metrics(http)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=_format(schema), temperature=0, max_tokens=12
    )
    after = metrics(http)

    def delta(name: str, suffix: str) -> float:
        return sample(after, name, suffix) - sample(before, name, suffix)

    assert delta("kvray:constrained_requests", "_total") == 1
    assert delta("kvray:grammar_compile_seconds", "_count") == 1  # a schema not seen before


def test_langchain_bind_tools_and_structured_output(server: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{server}/v1", api_key="x", temperature=0, max_tokens=60
    )
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])

    schema = {
        "title": "City",
        "description": "A city and its country",
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    out = llm.with_structured_output(schema, method="json_schema").invoke("The capital of France?")
    jsonschema.validate(out, schema)
