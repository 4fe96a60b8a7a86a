"""Per-request rows: page_table (position -> token slot) and token_pool (position -> id)."""

from __future__ import annotations

import numpy as np

from kvray.core import TableWrite, table_width


class TableManager:
    """Owns the scheduler's `page_table` and `token_pool` (the workers hold mirrors).

    page_table always stores raw token slots, whatever the page size. Every write that a
    worker cannot derive from a plan's `out_loc` goes through `write_slots`, which journals
    it for the next plan; rows freed since the last plan are journaled too.
    """

    def __init__(self, max_running_reqs: int, max_seq_len: int, page_size: int) -> None:
        width = table_width(max_seq_len, page_size)
        self.page_table = np.zeros((max_running_reqs, width), dtype=np.int32)
        self.token_pool = np.zeros((max_running_reqs, width), dtype=np.int32)
        self.max_running_reqs = max_running_reqs
        self._free_rows = list(range(max_running_reqs - 1, -1, -1))  # pop() yields row 0 first
        self._writes: list[TableWrite] = []
        self._freed: list[int] = []

    @property
    def available_rows(self) -> int:
        return len(self._free_rows)

    @property
    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def allocate(self) -> int:
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)
        self._freed.append(row)
        # Writes to a row that is gone would only be overwritten later; drop them now.
        if self._writes:
            self._writes = [w for w in self._writes if w.row != row]

    def write_slots(self, row: int, start: int, slots: np.ndarray) -> None:
        self.page_table[row, start : start + len(slots)] = slots
        self._writes.append(TableWrite(row, start, np.array(slots, dtype=np.int32)))

    @property
    def pending_writes(self) -> tuple[TableWrite, ...]:
        return tuple(self._writes)

    def drain(self) -> tuple[tuple[TableWrite, ...], tuple[int, ...]]:
        """Journaled writes and freed rows since the last call, for the next StepPlan."""
        writes, freed = tuple(self._writes), tuple(self._freed)
        self._writes.clear()
        self._freed.clear()
        return writes, freed
