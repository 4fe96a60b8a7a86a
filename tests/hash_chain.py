"""A model-free executor that checks the scheduler's slot bookkeeping end to end.

`HashChainExecutor` applies StepPlans through the worker's own `PlanMirror`, but its "K/V"
is a hash chain: the slot of position p holds h(p) = mix(h(p - 1), token(p)), read back
through the page table, and a sampled token is a function of the last hash. So the output
of a request is a pure function of its prompt (`reference_tokens`), like greedy decoding,
and any slot that is handed to two requests, evicted while in use, or left unwritten
changes the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvray.core import StepPlan, StepResult
from kvray.workers.mirror import PlanMirror

_MASK = (1 << 61) - 1
_SEED = 0x9E3779B97F4A7C15 & _MASK


def _mix(h: int, token: int) -> int:
    return ((h ^ (token + 0x632BE59BD9B4E019)) * 0x100000001B3) & _MASK


def _next_token(h: int, vocab_size: int) -> int:
    return (h >> 17) % vocab_size


def reference_tokens(
    prompt: Sequence[int], max_tokens: int, vocab_size: int, stop_ids: frozenset[int]
) -> list[int]:
    """What HashChainExecutor must produce for `prompt`, computed without any cache."""
    h = _SEED
    for t in prompt:
        h = _mix(h, t)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = _next_token(h, vocab_size)
        out.append(tok)
        if tok in stop_ids:
            break
        h = _mix(h, tok)
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
        if batch is not None:
            page_table, token_pool = self.page_table, self.mirror.token_pool.numpy()
            for i in range(plan.batch_size):
                row, start, n = int(plan.rows[i]), int(plan.starts[i]), int(plan.extend_lens[i])
                h = int(self.kv[page_table[row, start - 1]]) if start > 0 else _SEED
                for p in range(start, start + n):
                    h = _mix(h, int(token_pool[row, p]))
                    self.kv[page_table[row, p]] = h
                if plan.sample[i]:
                    tokens.append(_next_token(h, self.vocab_size))
            self.mirror.record_sampled(plan, torch.tensor(tokens, dtype=torch.int64))
        return StepResult(
            plan.step_id,
            np.asarray(tokens, dtype=np.int32),
            logprobs=np.zeros(len(tokens), dtype=np.float32),
        )
