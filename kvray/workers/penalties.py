"""Per-row logit processing on the worker: logit_bias, min_tokens and the repetition,
frequency and presence penalties of `SamplingParams` (vLLM's meanings and order).

Only rows whose params process logits hold state here (most rows hold none, and cost
nothing). A row's state is built on admission from what the scheduler sends (its prompt,
for a repetition penalty; the tokens it has already output, after a retraction or a replay;
the tokens min_tokens holds back), and it follows every token the row samples after that,
so every TP rank holds the same counts and changes the same logits.

Such requests never draft (the scheduler does not give them drafts): each step samples
one token per row, so a row's counts are exact at each of its samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvray.core import Admission, SamplingParams

if TYPE_CHECKING:
    from kvray.grammar.matcher import TokenBitmask


@dataclass
class _Row:
    params: SamplingParams
    counts: torch.Tensor | None  # float32 [V]: each token's count in the output
    seen: torch.Tensor | None  # bool [V]: in the prompt or the output (repetition penalty)
    bias_ids: torch.Tensor | None
    bias: torch.Tensor | None
    stop_ids: torch.Tensor | None  # held back while fewer than min_tokens are out
    num_out: int
    stops: tuple[int, ...] = ()  # stop_ids on the host, beside the grammar's host mask


class LogitProcessors:
    """The processed rows of one worker, by page-table row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[int, _Row] = {}

    def admit(self, adm: Admission) -> None:
        sp = adm.sampling
        if not sp.processes_logits:
            return
        v, dev = self.vocab_size, self.device
        out = torch.tensor(adm.output_ids, dtype=torch.long, device=dev)
        counts = seen = None
        if sp.frequency_penalty or sp.presence_penalty:
            counts = torch.zeros(v, dtype=torch.float32, device=dev)
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        if sp.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool, device=dev)
            seen[torch.tensor(adm.prompt_ids, dtype=torch.long, device=dev)] = True
            seen[out] = True
        bias_ids = bias = None
        if sp.logit_bias:
            pairs = dict(sp.logit_bias)
            bias_ids = torch.tensor(list(pairs), dtype=torch.long, device=dev)
            bias = torch.tensor(list(pairs.values()), dtype=torch.float32, device=dev)
        stop_ids = None
        if sp.min_tokens > len(adm.output_ids) and adm.stop_ids:
            stop_ids = torch.tensor(adm.stop_ids, dtype=torch.long, device=dev)
        self._rows[adm.row] = _Row(
            sp, counts, seen, bias_ids, bias, stop_ids, len(adm.output_ids), tuple(adm.stop_ids)
        )

    def free(self, row: int) -> None:
        self._rows.pop(row, None)

    def processes(self, rows: Sequence[int]) -> bool:
        return bool(self._rows) and any(r in self._rows for r in rows)

    @torch.inference_mode()  # (the model's logits are inference tensors)
    def apply_(
        self, logits: torch.Tensor, rows: Sequence[int], grammar: TokenBitmask | None = None
    ) -> None:
        """Process, in place, logits row i of every processed `rows[i]` (float32 logits).
        `grammar`: the step's mask of constrained rows, which min_tokens gives way to."""
        constrained = set() if grammar is None else set(grammar.indices)
        for i, r in enumerate(rows):
            row = self._rows.get(r)
            if row is None:
                continue
            x = logits[i, : self.vocab_size]  # (a padded head's extra columns stay)
            sp = row.params
            if row.bias is not None:
                x.index_add_(0, row.bias_ids, row.bias)  # type: ignore[arg-type]
            if row.stop_ids is not None and not (
                grammar is not None
                and i in constrained
                and _only_stops(grammar.bitmask[i], row.stops, self.vocab_size)
            ):
                x.index_fill_(0, row.stop_ids, float("-inf"))
            if row.seen is not None:
                r_pen = sp.repetition_penalty
                penalized = torch.where(x > 0, x / r_pen, x * r_pen)
                x.copy_(torch.where(row.seen, penalized, x))
            if row.counts is not None:
                x -= sp.frequency_penalty * row.counts
                x -= sp.presence_penalty * (row.counts > 0).float()

    def advance(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Each row sampled one token: count it."""
        if not self._rows:
            return
        for r, tok in zip(rows, token_ids, strict=True):
            row = self._rows.get(r)
            if row is None:
                continue
            row.num_out += 1
            if row.counts is not None:
                row.counts[tok] += 1
            if row.seen is not None:
                row.seen[tok] = True
            if row.stop_ids is not None and row.num_out >= row.params.min_tokens:
                row.stop_ids = None


_BITS = torch.arange(32, dtype=torch.int32)


def _only_stops(words: torch.Tensor, stops: Sequence[int], vocab_size: int) -> bool:
    """Whether a grammar mask row (int32 words) allows no token but `stops`: a complete
    grammar, which ends the request however few tokens are out (min_tokens cannot hold
    back the only tokens left: nothing would be left to sample). On the host, where
    xgrammar fills the mask: no copy from (or wait for) the device."""
    allowed = ((words.cpu().unsqueeze(1) >> _BITS) & 1).flatten()[:vocab_size].bool()
    allowed[list(stops)] = False
    return not bool(allowed.any())
