"""Text out: incremental detokenization with stop strings.

Text is produced token by token without ever splitting a multi-byte character: a token
whose bytes do not yet complete a character decodes to U+FFFD and is held until they do;
if the request ends first, that half character is dropped (vLLM does the same).
Each delta is the difference between decoding a short window of ids with and without
the new ones, so leading-space rules of SentencePiece/BPE tokenizers come out right. Text
that could be the start of a stop string is held back until it is known not to be; when
a stop string appears, the text is cut before it (after it, with `include_stop`) and
`stopped` is set; the first to appear wins (of two completed by one token, the one that
starts first). The concatenation
of every `push` and the final `flush` equals `text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer

_PREFIX_WINDOW = 5  # prompt tokens decoded as context for the first output token


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_ids[-_PREFIX_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text so far (cut at a stop string)
        self._emitted = 0  # chars of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return cast(str, text)  # one sequence of ids decodes to one string

    def _delta(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""

    def push(self, token_id: int, find_stop: bool = True) -> str:
        """Add one generated token; returns the text that is now safe to show. With
        `find_stop` False (a request's first min_tokens tokens, as vLLM) no stop string
        ends the text at this token; one that this token completes is not found later."""
        if self.stopped:
            return ""
        return self._append(self._delta(token_id), final=False, find_stop=find_stop)

    def flush(self) -> str:
        """The request ended: return what was held back (a possible stop-string prefix that
        never completed, text waiting on an unfinished character). A character whose bytes
        never completed is dropped, as vLLM does: the text never ends in half of one."""
        if self.stopped:
            return self._take(len(self.text))
        tail = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = tail[len(prefix) :] if len(tail) > len(prefix) else ""
        return self._append(delta.rstrip("\ufffd"), final=True)

    def _append(self, delta: str, final: bool, find_stop: bool = True) -> str:
        """Add decoded text, cut it at the first stop string, and return what may be shown:
        all of it once `final`, else all but a tail that could begin a stop string."""
        if delta:
            self.text += delta
            if self.stop and find_stop:
                # Each stop string is searched only where it would end inside `delta`:
                # one that earlier text completed (under min_tokens) is never found later.
                end = len(self.text) - len(delta) + 1
                hits = [
                    (i, s) for s in self.stop if (i := self.text.find(s, max(0, end - len(s)))) >= 0
                ]
                if hits:
                    at, stop = min(hits, key=lambda hit: hit[0])
                    self.text = self.text[: at + len(stop) if self.include_stop else at]
                    self.stopped = True
        if final or self.stopped or not self.stop:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
