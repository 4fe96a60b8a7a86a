"""Chat prompts in which message text never becomes a special token.

The chat template writes role markers as special tokens (`<|im_start|>`, `<|im_end|>`).
Tokenizing the rendered text as a whole would also turn a client's *typed* `<|im_end|>`
into the real token, letting message content forge a role boundary. Here only the
special tokens that the template itself wrote are special; special-token text inside a
message's content is tokenized as ordinary text.

Invariant: for a conversation whose contents hold no special-token text, the ids equal
`kvray.cluster.llm.chat_prompt_ids` (the offline LLM's tokenization), token for token.
"""

from __future__ import annotations

import re
import secrets
from functools import lru_cache
from typing import Any

from kvray.cluster.llm import chat_prompt_ids
from kvray.core import RequestRejected


@lru_cache(maxsize=8)
def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Every special added token's text, longest first (so the longest match wins)."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def chat_ids(
    tokenizer: Any, messages: list[dict[str, Any]], special_tokens_in_content: bool = False
) -> list[int]:
    """Token ids of `messages` through the chat template, ready for the assistant's reply.
    `special_tokens_in_content=True` keeps the plain tokenization (vLLM's default)."""
    ids = chat_prompt_ids(tokenizer, messages)
    pattern = _special_pattern(tokenizer)
    if special_tokens_in_content or pattern is None:
        return ids
    if not any(pattern.search(m.get("content") or "") for m in messages):
        return ids
    return _content_as_text(tokenizer, messages, pattern)


def _content_as_text(
    tokenizer: Any, messages: list[dict[str, Any]], pattern: re.Pattern[str]
) -> list[int]:
    text = _render(tokenizer, messages)
    # Where each content lands: render again with unique placeholders for the contents,
    # and check that putting the real contents back gives the same text.
    nonce = secrets.token_hex(8)
    marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
    placeholders = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    skeleton = _render(tokenizer, placeholders)
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
        ids.append(tokenizer.convert_tokens_to_ids(text[start:end]))
        at = end
    ids += _plain(tokenizer, text[at:])
    return ids


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _plain(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _refuse(messages: list[dict[str, Any]], pattern: re.Pattern[str]) -> list[int]:
    i, m = next((i, m) for i, m in enumerate(messages) if pattern.search(m.get("content") or ""))
    found = pattern.search(m["content"])
    assert found is not None
    raise RequestRejected(
        f"messages[{i}].content contains the special-token text {found.group()!r}, which this "
        "model's chat template cannot keep as plain text; remove it",
        "messages",
    )
