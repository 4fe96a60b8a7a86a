"""Tool calling: a chat request's tools become prompt text and, where the reply must call
one, a grammar; the reply's text becomes `tool_calls`.

The tool-call format is Hermes' (the one Qwen2 / Qwen3 chat templates write), and also
the documented default for models whose template has no tool support:

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments, a JSON object>}}
    </tool_call>

one block per call. In `auto` a reply is also read as calls when the whole of it is JSON
calls, the way Llama 3.x and Mistral templates ask for them: one `{"name": ..., "arguments"
(or "parameters"): {...}}` object or a list of them, optionally after `<|python_tag|>` or
`[TOOL_CALLS]`, every name one of the request's functions. How each `tool_choice` is
served:

- `none` (or no tools): the tools stay out of the prompt; the reply is text.
- `auto`: the tools go into the prompt (through the chat template when it renders
  `tools`, else as a system message that lists them and explains the format above); the
  reply is free text, and the `<tool_call>` blocks in it are its tool calls.
- `required`: as auto, but a grammar forces the reply to be a JSON array of
  `{"name", "arguments"}` objects (one item unless `parallel_tool_calls`), each item's
  arguments valid against its function's `parameters` schema.
- a named function: a grammar forces the reply to be that function's arguments.

History goes back through the template the same way: an assistant message's `tool_calls`
are written as `<tool_call>` blocks after its content, a `tool` message's content is the
result it carries.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvray.core import FinishReason, StructuredOutputsParams
from kvray.deploy.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# What may open a reply that is wholly JSON calls (Llama 3.x, Mistral); such a reply is
# held while streaming, and shown as text if it does not parse as calls.
JSON_OPENERS = ("{", "[", "<|python_tag|>", "[TOOL_CALLS]")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def _parameters(f: FunctionDefinition) -> dict[str, Any]:
    return f.parameters or _ANY_OBJECT


@dataclass(frozen=True)
class ToolMode:
    """How one chat request may call tools (`ChatCompletionRequest.tool_mode`)."""

    kind: str  # none | auto | required | named
    functions: tuple[FunctionDefinition, ...] = ()
    name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolMode:
        kind = req.tool_mode
        functions = tuple(t.function for t in req.tools or ())
        name = None
        if isinstance(req.tool_choice, NamedToolChoice):
            name = req.tool_choice.function.name
        parallel = req.parallel_tool_calls is not False
        return cls(kind, functions if kind != "none" else (), name, parallel)

    @property
    def calls_tools(self) -> bool:
        return self.kind != "none"

    # -- in: prompt and grammar ----------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (`apply_chat_template(tools=...)`)."""
        return [
            {"type": "function", "function": f.model_dump(exclude_none=True)}
            for f in self.functions
        ]

    def system_text(self) -> str:
        """The default format's instructions, for templates that do not render tools."""
        listed = "\n".join(json.dumps(t["function"]) for t in self.template_tools())
        return (
            "You can call these functions (JSON descriptions):\n"
            f"{listed}\n"
            "To call a function, reply with one block per call:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
            f"{CLOSE}"
        )

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar a `required` or named choice imposes (None for none / auto)."""
        if self.kind == "named":
            f = next(f for f in self.functions if f.name == self.name)
            return StructuredOutputsParams(json=_parameters(f))
        if self.kind != "required":
            return None
        one_call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
                    "required": ["name", "arguments"],
                }
                for f in self.functions
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def messages(
        self, history: Sequence[ChatMessage], template_renders_tools: bool
    ) -> list[dict[str, str]]:
        """The conversation as text messages for the chat template."""
        out = [{"role": m.role, "content": _message_text(m)} for m in history]
        if not self.calls_tools or template_renders_tools:
            return out
        instructions = self.system_text()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
        return out

    # -- out: tool calls -----------------------------------------------------------------------

    def reply(self, text: str, finish: FinishReason) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply, as its stream would give them: the
        text a stream shows before a call may begin (`ReplyStream`), then `reply_tail` of
        the rest. So the streamed content, joined, is the whole reply's."""
        if self.kind in ("none", "named"):
            return self.reply_tail(text, finish)
        stream = ReplyStream(self)
        shown, _ = stream.push(text, None)
        content, calls = self.reply_tail(text[len(shown) :], finish)
        if not calls:
            return text, []
        return (shown + (content or "")) or None, calls

    def reply_tail(self, text: str, finish: FinishReason) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of what a stream held of a finished reply (all of it
        unstreamed): a named function's call whatever ended it (as streamed, its arguments
        flow as they come); otherwise the calls of a reply that stopped by itself."""
        if self.kind == "named" or finish is FinishReason.STOP:
            return self.parse(text)
        return text, []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a reply. A reply that does not parse as the mode's
        format stays content."""
        if self.kind == "named":
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
                calls = [_call(i["name"], json.dumps(i["arguments"])) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls
        if self.kind == "auto":
            content, calls = _parse_blocks(text)
            if calls:
                return content, calls
            json_calls = _parse_json_calls(text, {f.name for f in self.functions})
            return (None, json_calls) if json_calls else (text, [])
        return text, []


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))


def _parse_blocks(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    for m in _BLOCK.finditer(text):
        try:
            item = json.loads(m.group(1))
            calls.append(_call(str(item["name"]), json.dumps(item.get("arguments", {}))))
        except (ValueError, TypeError, KeyError):
            return text, []  # a malformed block: the reply stays text
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def _parse_json_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls of a reply that is wholly JSON calls to functions in `names` (else [])."""
    body = text.strip()
    for prefix in JSON_OPENERS[2:]:
        body = body.removeprefix(prefix).lstrip()
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        if item["name"] not in names:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict | str):
            return []
        calls.append(_call(str(item["name"]), args if isinstance(args, str) else json.dumps(args)))
    return calls


def _message_text(m: ChatMessage) -> str:
    text = m.text()
    if not m.tool_calls:
        return text
    blocks = []
    for c in m.tool_calls:
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        blocks.append(_block(c.function.name, args))
    return "\n".join([text, *blocks] if text else blocks)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes the `tools` it is given (its own tool format)."""
    return bool(chat_template) and "tools" in str(chat_template)


class ReplyStream:
    """One choice's reply as it streams: each delta's content to show and its tool-call
    deltas. A named function's arguments stream as they come; an `auto` reply's text
    shows until a `<tool_call>` block may be starting and is held from there; a `required`
    reply is held whole. Held text is parsed when the reply ends."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self._shown = 0
        self._held = mode.kind == "required"
        self.called = False  # tool-call deltas were sent

    def push(self, delta: str, finish: FinishReason | None) -> tuple[str, list[ToolCallDelta]]:
        if self.mode.kind == "none":
            return delta, []
        if self.mode.kind == "named":
            return "", self._named(delta)
        self.text += delta
        shown = "" if self._held else self._show(self._safe_end())
        if finish is None:
            return shown, []
        content, calls = self.mode.reply_tail(self.text[self._shown :], finish)
        if not calls:
            return shown + self._show(len(self.text)), []
        self.called = True
        deltas = [
            ToolCallDelta(
                index=i,
                id=c.id,
                type="function",
                function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]
        return shown + (content or ""), deltas

    def _named(self, delta: str) -> list[ToolCallDelta]:
        out = []
        if not self.called:
            self.called = True
            head = FunctionCallDelta(name=self.mode.name, arguments="")
            out.append(ToolCallDelta(index=0, id=call_id(), type="function", function=head))
        if delta:
            out.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta)))
        return out

    def _safe_end(self) -> int:
        """Where the text that may be shown ends: before a `<tool_call>` (then held from
        there), or before a tail that could be its beginning. An `auto` reply that opens
        like JSON calls (`JSON_OPENERS`) is held whole; until its first visible text says,
        nothing shows."""
        if self._shown == 0 and self.mode.kind == "auto":
            head = self.text.lstrip()
            if any(head.startswith(o) for o in JSON_OPENERS):
                self._held = True
                return 0
            if not head or any(o.startswith(head) for o in JSON_OPENERS):
                return 0
        start = self.text.find(OPEN, self._shown)
        if start >= 0:
            self._held = True
            return start
        end = len(self.text)
        for k in range(min(len(OPEN) - 1, end - self._shown), 0, -1):
            if OPEN.startswith(self.text[end - k :]):
                return end - k
        return end

    def _show(self, end: int) -> str:
        piece, self._shown = self.text[self._shown : end], max(end, self._shown)
        return piece
