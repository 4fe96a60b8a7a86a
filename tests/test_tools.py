"""Tool calling's text side (`kvray/deploy/tools.py`), no model: the grammar each
tool_choice imposes, history rendered for templates without tool support, and replies
(whole or streamed in arbitrary pieces) split into content and tool calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core import FinishReason
from kvray.deploy.protocol import ChatCompletionRequest
from kvray.deploy.tools import ReplyStream, ToolMode

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def mode(**kw: object) -> ToolMode:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **kw}
    return ToolMode.of(ChatCompletionRequest.model_validate(body))


def test_required_grammar_is_an_array_of_valid_calls() -> None:
    spec = mode(tool_choice="required", parallel_tool_calls=False).structured_outputs()
    assert spec is not None
    schema = json.loads(spec.key[1])
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "x", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, schema)
    named = mode(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs() is not None
    assert json.loads(named.structured_outputs().key[1]) == WEATHER["function"]["parameters"]
    assert mode().structured_outputs() is None and mode(tool_choice="none").kind == "none"


def test_history_and_instructions_for_a_template_without_tools() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        ],
        "tools": [WEATHER],
    }
    req = ChatCompletionRequest.model_validate(body)
    msgs = ToolMode.of(req).messages(req.messages, template_renders_tools=False)
    assert msgs[0]["content"].startswith("Be brief.") and "get_weather" in msgs[0]["content"]
    assert msgs[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert msgs[3] == {"role": "tool", "content": "-3 C"}
    native = ToolMode.of(req).messages(req.messages, template_renders_tools=True)
    assert native[0] == {"role": "system", "content": "Be brief."}


AUTO_REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(cuts=st.lists(st.integers(0, len(AUTO_REPLY)), max_size=12))
def test_auto_reply_streamed_in_any_pieces(cuts: list[int]) -> None:
    """Content shows up to the first block and never a piece of `<tool_call>`; the calls
    come at the end, as whole ones do."""
    bounds = [0, *sorted(cuts), len(AUTO_REPLY)]
    pieces = [AUTO_REPLY[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stream = ReplyStream(mode())
    shown, deltas = "", []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        text, calls = stream.push(piece, FinishReason.STOP if last else None)
        shown += text
        deltas += calls
        assert "<" not in shown or last
    assert shown == "Let me check.\n" and stream.called
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather"), (1, "get_time")]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    # the whole reply's content is what the stream showed, whatever its pieces
    content, whole = mode().reply(AUTO_REPLY, FinishReason.STOP)
    assert content == shown and [c.function.name for c in whole] == ["get_weather", "get_time"]


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    before=st.sampled_from(["", "  ", "Let me check. ", "Sure.\n\n"]),
    after=st.sampled_from(["", " ", " Done.", "\nThen I will answer."]),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_streamed_content_joins_to_the_whole_replys(
    before: str, after: str, cuts: list[int]
) -> None:
    reply = f'{before}<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>{after}'
    bounds = [0, *sorted(min(c, len(reply)) for c in cuts), len(reply)]
    stream, shown = ReplyStream(mode()), ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        text, _ = stream.push(reply[a:b], FinishReason.STOP if i == len(bounds) - 2 else None)
        shown += text
    content, calls = mode().reply(reply, FinishReason.STOP)
    assert [c.function.name for c in calls] == ["get_time"] and stream.called
    assert (content or "") == shown


def test_replies_that_are_not_calls_stay_text() -> None:
    assert mode().reply("Just text, <b>bold</b>.", FinishReason.STOP) == (
        "Just text, <b>bold</b>.",
        [],
    )
    cut = '[{"name": "get_weather", "argu'
    assert mode(tool_choice="required").reply(cut, FinishReason.LENGTH) == (cut, [])
    stream = ReplyStream(mode())
    text, calls = stream.push("<tool_call>{not json</tool_call>", FinishReason.STOP)
    assert text == "<tool_call>{not json</tool_call>" and calls == [] and not stream.called


LLAMA_REPLY = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}'
MISTRAL_REPLY = '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize("reply", [LLAMA_REPLY, MISTRAL_REPLY, LLAMA_REPLY[14:] + "\n"])
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(cut=st.integers(0, 60))
def test_auto_reads_a_reply_that_is_wholly_json_calls(reply: str, cut: int) -> None:
    """Llama 3.x / Mistral style: the whole reply is the call(s); streamed in two pieces,
    nothing of it shows as content."""
    content, calls = mode().reply(reply, FinishReason.STOP)
    assert content is None and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    assert json.loads(calls[0].function.arguments) in ({"city": "Lima"}, {})
    stream = ReplyStream(mode())
    first, none = stream.push(reply[:cut], None)
    last, deltas = stream.push(reply[cut:], FinishReason.STOP)
    assert first == "" and none == [] and last == "" and stream.called
    assert deltas[0].function.name == calls[0].function.name


def test_json_that_is_not_a_call_to_a_given_function_stays_text() -> None:
    for text in (
        '{"name": "rm_rf", "arguments": {}}',
        '{"answer": 42}',
        "[1, 2]",
        "{oops",
        '{"name": ["x"]}',
    ):
        assert mode().reply(text, FinishReason.STOP) == (text, [])
        stream = ReplyStream(mode())
        shown, calls = stream.push(text, FinishReason.STOP)
        assert shown == text and calls == []
