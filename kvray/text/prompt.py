"""Text in: the tokenizer, plain prompts, and chat prompts in which message text never
becomes a special token.

The chat template writes role markers as special tokens (`<|im_start|>`, `<|im_end|>`).
Tokenizing the rendered text as a whole would also turn a client's *typed* `<|im_end|>`
into the real token, letting message content forge a role boundary. `chat_ids` makes only
the special tokens that the template itself wrote special; special-token text inside a
message's content is tokenized as ordinary text (`special_tokens_in_content=True` keeps
the plain tokenization, vLLM's default).

Invariant: for a conversation whose contents hold no special-token text, both ways give
the same ids, token for token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from kvray.core import RequestRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    Tokenizer: TypeAlias = PreTrainedTokenizerBase

Message = Mapping[str, str]  # {"role": ..., "content": ...}
Tools = Sequence[Mapping[str, Any]] | None  # OpenAI tool definitions, for the template


def load_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """A plain prompt's ids (with the special tokens the tokenizer adds, e.g. a BOS, unless
    `add_special_tokens` is false)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def document_start_id(tokenizer: Tokenizer) -> int | None:
    """What an empty document starts with: `<|endoftext|>` (the document separator) where
    the vocabulary has it, else the BOS token, else EOS; None if it has none of them."""
    vocab = tokenizer.get_vocab()
    for candidate in ("<|endoftext|>", tokenizer.bos_token, tokenizer.eos_token):
        if isinstance(candidate, str) and candidate in vocab:
            return int(vocab[candidate])
    return None


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes one: the Jinja text itself, or
    a file holding it. ValueError when `value` is neither."""
    if "{" in value:  # Jinja text ({{ ... }} / {% ... %}): no file name holds that
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(
        f"chat_template {value!r} is neither a file nor a Jinja template (no {{{{ or {{% in it)"
    )


def join_text_parts(texts: Iterable[str]) -> str:
    """One message's text parts as the one string the template renders: joined by
    newlines, as vLLM joins them."""
    return "\n".join(texts)


def text_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is OpenAI's list of text parts (`[{"type": "text", "text":
    ...}]`) with that content joined into one string, as the server reads them; ValueError
    naming the message for any other kind of part."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            kinds = {str(p.get("type")) if isinstance(p, Mapping) else "?" for p in content}
            if kinds - {"text"}:
                got = ", ".join(sorted(kinds - {"text"}))
                raise ValueError(f"messages[{i}].content: kvray takes text parts only, got {got}")
            m = {**m, "content": join_text_parts(str(p["text"]) for p in content)}
        out.append(dict(m))
    return out


def chat_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    special_tokens_in_content: bool = False,
    tools: Tools = None,
    options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` through the chat template, ready for the assistant's reply
    (`tools` are handed to the template, for templates that render them). `options` go to
    the template as well: `add_generation_prompt` (default true), `continue_final_message`
    (the reply continues the last message), `chat_template` (another template than the
    tokenizer's), and any variable the template reads. Raises
    RequestRejected (param `messages`) when the model has no chat template, or when typed
    special-token text cannot be kept as text."""
    if not getattr(tokenizer, "chat_template", None) and not (options or {}).get("chat_template"):
        raise RequestRejected("this model's tokenizer has no chat template", "messages")
    text = _render(tokenizer, messages, tools, options)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    pattern = _special_pattern(tokenizer)
    if special_tokens_in_content or pattern is None:
        return ids
    if not any(pattern.search(m.get("content") or "") for m in messages):
        return ids
    return _content_as_text(tokenizer, messages, pattern, tools, options)


@lru_cache(maxsize=8)
def _special_pattern(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """Every special added token's text, longest first (so the longest match wins)."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _content_as_text(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    pattern: re.Pattern[str],
    tools: Tools = None,
    options: Mapping[str, Any] | None = None,
) -> list[int]:
    text = _render(tokenizer, messages, tools, options)
    # Where each content lands: render again with unique placeholders for the contents,
    # and check that putting the real contents back gives the same text.
    nonce = secrets.token_hex(8)
    marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
    placeholders = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    skeleton = _render(tokenizer, placeholders, tools, options)
    pieces: list[str] = []
    rest = skeleton
    for mark in marks:
        before, found, rest = rest.partition(mark)
        if not found or mark in rest:
            return _refuse(messages, pattern)  # a template that drops or repeats a message
        pieces.append(before)
    pieces.append(rest)
    rebuilt = "".join(p + m["content"] for p, m in zip(pieces, messages, strict=False))
    if rebuilt + pieces[-1] != text:
        return _refuse(messages, pattern)  # a template that rewrites the content it shows
    # The template's own special tokens: those inside the template pieces.
    specials: list[tuple[int, int]] = []
    offset = 0
    for i, piece in enumerate(pieces):
        specials += [(offset + s.start(), offset + s.end()) for s in pattern.finditer(piece)]
        offset += len(piece) + (len(messages[i]["content"]) if i < len(messages) else 0)
    # Between two of them the tokenizer would work on the text independently anyway, so
    # tokenizing each stretch on its own, with special tokens split, changes only what was
    # forged.
    ids: list[int] = []
    at = 0
    for start, end in specials:
        ids += _plain(tokenizer, text[at:start])
        special = tokenizer.convert_tokens_to_ids(text[start:end])
        assert isinstance(special, int)
        ids.append(special)
        at = end
    ids += _plain(tokenizer, text[at:])
    return ids


def _render(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    tools: Tools,
    options: Mapping[str, Any] | None,
) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        **{"add_generation_prompt": True, **(options or {})},
    )
    assert isinstance(text, str)
    return text


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as ordinary text: special-token text in it is split like any other."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _refuse(messages: Sequence[Message], pattern: re.Pattern[str]) -> list[int]:
    i, m = next((i, m) for i, m in enumerate(messages) if pattern.search(m.get("content") or ""))
    found = pattern.search(m["content"])
    assert found is not None
    raise RequestRejected(
        f"messages[{i}].content contains the special-token text {found.group()!r}, which this "
        "model's chat template cannot keep as plain text; remove it",
        "messages",
    )
