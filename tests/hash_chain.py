"""A model-free executor that checks the scheduler's slot bookkeeping end to end.

`HashChainExecutor` applies StepPlans through the worker's own `PlanMirror`, but its "K/V"
is a hash chain: the slot of position p holds h(p) = mix(h(p - 1), token(p)), read back
through the page table, and a sampled token is a function of the last hash. So the output
of a request is a pure function of its prompt (`reference_tokens`), like greedy decoding,
and any slot that is handed to two requests, evicted while in use, or left unwritten
changes the output.

Its tokens often repeat (most follow from the previous token alone, the rest from the
hash), so n-gram drafts (speculative decoding) are checked and often held: a plan's drafts
are checked as the model worker checks them, keeping the samples up to the first miss.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvray.core import StepPlan, StepResult
from kvray.workers.mirror import PlanMirror

_MASK = (1 << 61) - 1
_SEED = 0x9E3779B97F4A7C15 & _MASK


def _mix(h: int, token: int) -> int:
    return ((h ^ (token + 0x632BE59BD9B4E019)) * 0x100000001B3) & _MASK


def _next_token(h: int, token: int, vocab_size: int) -> int:
    """The token after one with hash `h`: mostly the token after `token` in a fixed
    cycle (so drafts often hold), a quarter of the time one that depends on the hash."""
    if (h >> 7) % 4 == 0:
        return (h >> 17) % vocab_size
    return (token * 7 + 3) % vocab_size


def reference_tokens(
    prompt: Sequence[int], max_tokens: int, vocab_size: int, stop_ids: frozenset[int]
) -> list[int]:
    """What HashChainExecutor must produce for `prompt`, computed without any cache."""
    h = _SEED
    for t in prompt:
        h = _mix(h, t)
    out: list[int] = []
    last = prompt[-1]
    while len(out) < max_tokens:
        tok = _next_token(h, last, vocab_size)
        out.append(tok)
        if tok in stop_ids:
            break
        h = _mix(h, tok)
        last = tok
    return out


class HashChainExecutor:
    def __init__(self, num_slots: int, max_rows: int, width: int, vocab_size: int) -> None:
        self.kv = np.zeros(num_slots, dtype=np.int64)
        self.mirror = PlanMirror(max_rows, width, "cpu")
        self.vocab_size = vocab_size

    @property
    def page_table(self) -> np.ndarray:
        return self.mirror.page_table.numpy()

    def execute(self, plan: StepPlan) -> StepResult:
        assert len(np.unique(plan.out_loc)) == len(plan.out_loc), "two tokens share a slot"
        batch = self.mirror.apply(plan)
        tokens: list[int] = []
        counts: list[int] = []
        at: list[tuple[int, int]] = []  # (row, position) where each kept token goes
        drafts = plan.num_drafts if plan.num_drafts is not None else np.zeros(plan.batch_size)
        if batch is not None:
            page_table, token_pool = self.page_table, self.mirror.token_pool.numpy()
            for i in range(plan.batch_size):
                row, start, n = int(plan.rows[i]), int(plan.starts[i]), int(plan.extend_lens[i])
                h = int(self.kv[page_table[row, start - 1]]) if start > 0 else _SEED
                checked = start + n - 1 - int(drafts[i])  # the first position sampled at
                kept = 0
                for p in range(start, start + n):
                    tok = int(token_pool[row, p])
                    h = _mix(h, tok)
                    self.kv[page_table[row, p]] = h
                    if plan.sample[i] and p >= checked:
                        out = _next_token(h, tok, self.vocab_size)
                        tokens.append(out)
                        at.append((row, p + 1))
                        kept += 1
                        if p + 1 < start + n and out == int(token_pool[row, p + 1]):
                            continue  # the draft held: check the next one
                        break
                if plan.sample[i]:
                    counts.append(kept)
            if at:
                rows, positions = np.asarray(at, dtype=np.int64).T
                self.mirror.record_tokens(rows, positions, np.asarray(tokens, dtype=np.int64))
        return StepResult(
            plan.step_id,
            np.asarray(tokens, dtype=np.int32),
            logprobs=np.zeros(len(tokens), dtype=np.float32),
            num_tokens=np.asarray(counts, dtype=np.int32) if plan.num_drafts is not None else None,
        )
