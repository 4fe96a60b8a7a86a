"""GrammarRows: the grammar matchers of one worker's constrained rows.

Where the matcher lives, and why: next to the sampler, in the worker that samples (every
TP rank samples identically, so every rank keeps the same matchers and applies the same
masks). The worker is the one place that knows each token the moment it is sampled, so a
matcher never waits on the scheduler: with overlapped steps the scheduler learns tokens
one step late, but the next plan's mask is computed here from a matcher that has already
taken the previous token. The scheduler stays free of grammar state (it plans on lengths
only) and tells the worker just what it cannot know: at admission, a constrained row's
stop tokens and the tokens the request has already output.

Invariant: between steps, a live constrained row's matcher has accepted exactly the tokens
its request holds on this worker: none at first admission; after a retraction or a worker
replay (a re-admission, which the scheduler makes only once no token of the request is in
flight), the `Admission.output_ids` it re-advances over; then each token the row samples.
A row is dropped when the plan frees it (finish, abort, retraction). A matcher that has
taken a stop token is done: a plan planned before the scheduler saw that token may still
sample the row once more (the token is discarded); that sample is left unconstrained.

Unconstrained rows cost nothing: no bitmask is filled or applied for them.

The front ends compile every spec before the engine sees it; a spec that reaches a worker
unchecked (an engine-level caller) and does not compile allows only its stop tokens, so
its request ends at once instead of running unconstrained or failing the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvray.core import Admission
from kvray.grammar.compiler import GrammarCompiler, GrammarError

if TYPE_CHECKING:
    import xgrammar


_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenBitmask:
    """Allowed tokens of a step's constrained rows: `bitmask[i]` (int32 words, bit j of
    word w allows token 32 * w + j) applies to logits row `i` for each i in `indices`."""

    bitmask: torch.Tensor  # int32 [S, ceil(V / 32)], rows outside `indices` unused
    indices: list[int]

    def apply_(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows -> -inf, in place (any float dtype)."""
        import xgrammar as xgr

        bitmask = self.bitmask
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[-1], indices=self.indices
        )


@dataclass
class _Row:
    grammar: Future[xgrammar.CompiledGrammar]
    stop_ids: tuple[int, ...]
    replay: tuple[int, ...]  # tokens to accept before the first mask
    matcher: Any = None  # xgrammar.GrammarMatcher, once the grammar is compiled
    accepted: list[int] = field(default_factory=list)
    failed: bool = False  # the grammar did not compile: only stop tokens are allowed


class GrammarRows:
    """`compiler` is called (once) on the first constrained admission."""

    def __init__(self, compiler: Callable[[], GrammarCompiler], max_rows: int) -> None:
        self._make_compiler = compiler
        self._compiler: GrammarCompiler | None = None
        self._rows: dict[int, _Row] = {}
        self._max_rows = max_rows
        self._bitmask: torch.Tensor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def __contains__(self, row: int) -> bool:
        return row in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def admit(self, adm: Admission) -> None:
        """A row starts serving a request; a constrained one starts compiling its grammar
        (in the background: the step's forward pass runs meanwhile)."""
        params = adm.sampling.structured_outputs
        if params is None:
            return
        future = self.compiler.prefetch(params)
        self._rows[adm.row] = _Row(future, adm.stop_ids, adm.output_ids)

    def free(self, row: int) -> None:
        self._rows.pop(row, None)

    def _matcher(self, row: _Row) -> Any:
        """The row's matcher, made (and re-advanced) on first use; None if it failed."""
        if row.matcher is None and not row.failed:
            import xgrammar as xgr

            try:
                grammar = row.grammar.result()
            except GrammarError:
                row.failed = True
                return None
            row.matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=list(row.stop_ids))
            for t in row.replay:
                if row.failed:
                    break
                self._accept(row, t)
        return row.matcher

    def _accept(self, row: _Row, token: int) -> None:
        """The matcher takes `token`. One it refuses (a token its mask did not allow, as
        when no token was allowed at all and the sampler still had to pick one) puts the
        row out of step with its grammar: the row is failed like one whose grammar did not
        compile, so its request ends at its next token (only stop tokens are allowed).
        Raising instead would fail the worker, and a replay would fail it the same way."""
        assert row.matcher is not None
        if not row.matcher.accept_token(token):
            _log.warning(
                "grammar matcher refused token %d after %d tokens; ending the request",
                token,
                len(row.accepted),
            )
            row.matcher, row.failed = None, True
            return
        row.accepted.append(token)

    def token_bitmask(self, rows: Sequence[int]) -> TokenBitmask | None:
        """The mask for a step whose sampling rows are `rows` (batch order), or None when
        none of them is constrained (the common case costs one dict lookup per row)."""
        live = self._rows
        if not live:
            return None
        picked = [(i, live[r]) for i, r in enumerate(rows) if r in live]
        if not picked:
            return None
        indices: list[int] = []
        bitmask = self._buffer()
        for i, row in picked:
            matcher = self._matcher(row)
            if matcher is None:
                _only(bitmask[i], row.stop_ids)
            elif matcher.is_terminated():
                continue  # done: this sample is discarded (see the module docstring)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
            indices.append(i)
        if not indices:
            return None
        return TokenBitmask(bitmask[: len(rows)], indices)

    def advance(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Each constrained row takes the token it sampled (batch order, as `rows`)."""
        live = self._rows
        if not live:
            return
        for r, t in zip(rows, token_ids, strict=True):
            row = live.get(r)
            if row is None:
                continue
            matcher = self._matcher(row)
            if matcher is not None and not matcher.is_terminated():
                self._accept(row, int(t))

    def accepted(self, row: int) -> list[int]:
        """The tokens row's matcher has taken (replayed ones first): for invariant checks."""
        state = self._rows[row]
        self._matcher(state)
        return list(state.accepted)

    def _buffer(self) -> torch.Tensor:
        if self._bitmask is None:
            import xgrammar as xgr

            vocab = self.compiler.vocab_size
            self._bitmask = xgr.allocate_token_bitmask(self._max_rows, vocab)
        return self._bitmask


def _only(words: torch.Tensor, tokens: Sequence[int]) -> None:
    """Set one bitmask row to allow exactly `tokens`."""
    words.zero_()
    for t in tokens:
        bit = 1 << (t % 32)
        words[t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
