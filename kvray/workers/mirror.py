"""PlanMirror: a worker's copy of the scheduler's page_table and token_pool, kept in step by
applying each StepPlan's deltas. The one implementation of the plan protocol's consuming
side: the model worker runs on it, and so do the test suite's model-free executors.

Deltas are applied in the order `StepPlan` documents: freed rows, admissions, table writes,
then the batch (its prompt ids into token_pool, its out_loc into page_table). Sampled tokens
are written back by `record_sampled`, which is why decode plans carry no input ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvray.core import SamplingParams, StepPlan


@dataclass(frozen=True)
class MirroredBatch:
    """A plan's batch as index tensors on the mirror's device."""

    rows: torch.Tensor  # int64 [B]
    token_rows: torch.Tensor  # int64 [T]: the row of each computed token
    positions: torch.Tensor  # int64 [T]: its position in the row


class PlanMirror:
    def __init__(self, max_rows: int, width: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.page_table = torch.zeros((max_rows, width), dtype=torch.int64, device=self.device)
        self.token_pool = torch.zeros((max_rows, width), dtype=torch.int64, device=self.device)
        # Live rows, with what the sampler needs for each: (params, seed).
        self.sampling: dict[int, tuple[SamplingParams, int]] = {}

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        """int64 on the device (copied: plans may arrive as read-only buffers)."""
        return torch.tensor(a, dtype=torch.int64).to(self.device)

    def apply(self, plan: StepPlan) -> MirroredBatch | None:
        """Apply `plan`; returns its batch, or None for a plan with nothing to compute.
        A plan that breaks the protocol (a live row admitted again, a batch row that was
        never admitted) raises RuntimeError."""
        for row in plan.freed_rows:
            self.sampling.pop(row, None)
        for adm in plan.admitted:
            if adm.row in self.sampling:
                raise RuntimeError(f"plan {plan.step_id} admits live row {adm.row}")
            self.sampling[adm.row] = (adm.sampling, adm.seed)
        for w in plan.table_writes:
            self.page_table[w.row, w.start : w.start + len(w.slots)] = self._tensor(w.slots)
        if plan.is_empty:
            return None
        stray = [int(r) for r in plan.rows if int(r) not in self.sampling]
        if stray:
            raise RuntimeError(f"plan {plan.step_id} schedules rows {stray}, never admitted")
        if plan.fill_ids.size:
            fill_rows, fill_pos = plan.spans(plan.fill_lens)
            self.token_pool[self._tensor(fill_rows), self._tensor(fill_pos)] = self._tensor(
                plan.fill_ids
            )
        token_rows, positions = plan.spans(plan.extend_lens)
        batch = MirroredBatch(
            rows=self._tensor(plan.rows),
            token_rows=self._tensor(token_rows),
            positions=self._tensor(positions),
        )
        self.page_table[batch.token_rows, batch.positions] = self._tensor(plan.out_loc)
        return batch

    def input_ids(self, batch: MirroredBatch) -> torch.Tensor:
        """The token id at each computed position (prompt ids, or last step's samples)."""
        return self.token_pool[batch.token_rows, batch.positions]

    def sampling_of(self, plan: StepPlan) -> list[tuple[SamplingParams, int]]:
        """(params, seed) of each row that samples this step, in batch order."""
        return [self.sampling[int(r)] for r in plan.sampled_rows]

    def record_sampled(self, plan: StepPlan, token_ids: torch.Tensor) -> None:
        """Write the step's sampled tokens where the next step reads them."""
        rows, pos = self._tensor(plan.sampled_rows), self._tensor(plan.sampled_positions)
        self.token_pool[rows, pos] = token_ids.to(self.device, torch.int64)

    def record_tokens(self, rows: np.ndarray, positions: np.ndarray, ids: np.ndarray) -> None:
        """token_pool[rows[j], positions[j]] = ids[j] (tokens sampled at those positions)."""
        self.token_pool[self._tensor(rows), self._tensor(positions)] = self._tensor(ids)

    def tokens_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """token_pool[rows[j], positions[j]] for every j (int64, on the host)."""
        out: np.ndarray = self.token_pool[self._tensor(rows), self._tensor(positions)].cpu().numpy()
        return out
