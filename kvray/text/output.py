"""One request's output as its events arrive, shared by the offline `LLM` and the server.

`OutputState.add(event)` records the token, detokenizes it incrementally and cuts the text
at a stop string. A stop string is the front end's to see (the engine knows token ids
only), so when one completes while the engine still runs the request, the delta says
`stop_string_hit` once: the caller ends the request with `FinishReason.STOP`, and the
finishing event that follows completes the output. Tokens the engine produced after the
stop string are not part of the output.

Invariants: the finish reason is set by the finishing event alone, and is `stop` whenever
a stop string cut the text (a stop string wins over length, even when the token that
completed it was the last one allowed); the concatenation of every delta's text equals
`text`; `token_ids` counts every token that was output, a stop token id included (whose
text is not shown, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvray.core import FinishReason, SamplingParams, TokenEvent, ended_on_stop_token
from kvray.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kvray.text.prompt import Tokenizer

# A generated token with its logprob and, when asked for, the top alternatives.
Logprob = tuple[int, float, tuple[tuple[int, float], ...] | None]


@dataclass(frozen=True)
class OutputDelta:
    """What one event added to the output."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_string_hit: bool = False  # end the request now, with FinishReason.STOP

    @property
    def shows_something(self) -> bool:
        """Text to show, or the end of the output."""
        return bool(self.text) or self.finish_reason is not None


class OutputState:
    """`tokenizer` None: token ids only (no text, and no stop strings)."""

    def __init__(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, tokenizer: Tokenizer | None
    ) -> None:
        if tokenizer is None and sampling.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        self.sampling = sampling
        self._detok: IncrementalDetokenizer | None = None
        if tokenizer is not None:
            self._detok = IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                sampling.stop,
                sampling.skip_special_tokens,
                sampling.include_stop_str_in_output,
            )
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache

    @property
    def text(self) -> str:
        return "" if self._detok is None else self._detok.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def _stopped(self) -> bool:
        return self._detok is not None and self._detok.stopped

    def add(self, event: TokenEvent) -> OutputDelta:
        """Record one event of this request (events after the finishing one are ignored)."""
        if self.finished:
            return OutputDelta()
        text, hit = "", False
        tokens: tuple[int, ...] = ()
        logprobs: tuple[Logprob, ...] = ()
        if event.token_id is not None and not self._stopped:
            tokens = (event.token_id,)
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                logprobs = ((event.token_id, event.logprob, event.top_logprobs),)
                self.logprobs += logprobs
            shown = self.sampling.include_stop_str_in_output or not ended_on_stop_token(event)
            if self._detok is not None and shown:
                # Stop strings count from the token after min_tokens, as stop tokens do.
                find_stop = len(self.token_ids) > self.sampling.min_tokens
                text = self._detok.push(event.token_id, find_stop)
                hit = self._detok.stopped and not event.finished
        if event.finish_reason is not None:
            self.finish_reason = FinishReason.STOP if self._stopped else event.finish_reason
            self.num_cached_tokens = event.num_cached_tokens or 0
            if self._detok is not None:
                text += self._detok.flush()
        return OutputDelta(text, tokens, logprobs, self.finish_reason, hit)
