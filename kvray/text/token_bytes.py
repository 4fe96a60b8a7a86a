"""Each token's own bytes, for logprobs: what OpenAI's `bytes` field holds, and a `token`
string that tells apart tokens which are only part of a character.

Decoding one id alone (`tokenizer.decode([id])`) turns every token that holds part of a
multi-byte character (an emoji's, a CJK character's) into U+FFFD: the bytes are lost, and
all such tokens look alike. The bytes come instead from the vocabulary:
- byte-level BPE (GPT-2's, Llama 3's, Qwen's, SmolLM's): each character of a piece stands
  for one byte, by GPT-2's fixed byte-to-character table;
- SentencePiece (Llama 2's): `<0xAB>` pieces are that byte (byte fallback), and `▁` a space;
- added and special tokens are their text.
A token whose bytes are not UTF-8 alone is written with `\\xAB` escapes for the bytes that
are not (as DeepSeek's API does; `bytes` still has them raw).

`TextOffsets` counts where each token's text starts in the choice's text, feeding the
bytes through one incremental UTF-8 decoder: the tokens of a character split over several
start where it does, and the text after it once it is complete.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves; the others (controls, space, 127-160, 173) take the characters from 256 on,
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _has_byte_level(node: Any) -> bool:
    """Whether a tokenizer.json `decoder` entry is (or contains) GPT-2's byte level."""
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel":
            return True
        return any(_has_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_byte_level(v) for v in node)
    return False


def token_text(raw: bytes) -> str:
    """A token's bytes as the `token` string: UTF-8 text, `\\xAB` for bytes that are not."""
    return raw.decode("utf-8", errors="backslashreplace")


class TokenBytes:
    """`token_bytes(id)`: the token's bytes (see the module docstring). Pieces are looked up
    on first use and kept."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._lookup(token_id)
        return raw

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary is byte-level BPE: read from the tokenizer's JSON (the
        whole vocabulary, megabytes) on the first logprobs asked for, not at start-up."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        return _has_byte_level(decoder)

    def _lookup(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""  # an id past the tokenizer's vocabulary (the model's is padded)
        if token_id in self._added:
            return piece.encode()
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte[1], 16)])
        if self._byte_level:
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif _METASPACE in piece:
            return piece.replace(_METASPACE, " ").encode()
        return str(self.tokenizer.decode([token_id])).encode()


class TextOffsets:
    """Where each token's text starts in one choice's text, token after token (a choice's
    tokens may come in several calls, as streamed chunks do)."""

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool = True) -> None:
        self.token_bytes = token_bytes
        self.skip = token_bytes.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def starts(self, token_ids: Iterable[int]) -> list[int]:
        out = []
        for token_id in token_ids:
            out.append(self.offset)
            if token_id not in self.skip:
                self.offset += len(self._decoder.decode(self.token_bytes(token_id)))
        return out
