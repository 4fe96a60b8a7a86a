"""PrefillAdder: admits waiting requests into one step under a token and page budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvray.core import Req, ReqStatus, div_ceil
from kvray.scheduler.cache import CacheManager
from kvray.scheduler.table import TableManager


@dataclass
class PrefillAdder:
    """One step's prefill budget.

    `token_budget` is how many prefill tokens the step may still compute. Pages are
    checked against the live `cache.available_pages` (free + evictable) minus the pages
    earlier entries of this step already committed, so locking a matched prefix (which
    makes it unevictable) is seen at once. `reserved_pages` is headroom kept for the
    running requests' next decode pages, so admitting a prompt does not immediately force
    a retraction. A request's whole max_tokens is never reserved: decode grows page by
    page and retracts when the pool runs dry. `even_chunks` is set for a step with decodes:
    they wait for the whole step, and beside them the budget is about the same from step
    to step; a step without decodes delays no one and takes all it may (a later step's
    budget may be smaller, once decodes run).
    """

    cache: CacheManager
    table: TableManager
    token_budget: int
    committed_pages: int = 0
    reserved_pages: int = 0
    even_chunks: bool = False

    @property
    def pages_left(self) -> int:
        return self.cache.available_pages - self.committed_pages

    def chunk_for(self, req: Req) -> int:
        """Tokens of `req` to prefill this step (0 if none fit). With `even_chunks`, a
        prompt longer than the budget goes in the fewest chunks the budget allows, evenly
        sized (in whole pages): as many steps as taking the whole budget each time while
        the budget holds, but the longest of them, which every running stream waits out,
        is as short as that many steps can make it (256 tokens under a budget of 192: 128
        + 128, not 192 + 64)."""
        ps = self.cache.page_size
        remaining = len(req.input_ids) - req.cached_len
        chunk = min(remaining, self.token_budget)
        if self.even_chunks and 0 < chunk < remaining:
            steps = div_ceil(remaining, chunk)
            chunk = min(div_ceil(div_ceil(remaining, steps), ps) * ps, chunk)
        # The page holding position cached_len may already be partly ours.
        have = div_ceil(req.cached_len, ps) * ps - req.cached_len
        spare_pages = max(self.pages_left - self.reserved_pages, 0)
        return max(min(chunk, have + spare_pages * ps), 0)

    def take(self, req: Req, chunk: int) -> None:
        """Commit `chunk` tokens of `req` to this step's budget."""
        ps = self.cache.page_size
        self.token_budget -= chunk
        self.committed_pages += div_ceil(req.cached_len + chunk, ps) - div_ceil(req.cached_len, ps)

    def try_admit(self, req: Req) -> int:
        """match -> lock -> re-check space -> take a row and copy the matched slots into it.
        Returns the chunk admitted (0: not admitted, and nothing is held)."""
        if self.table.available_rows == 0 or self.token_budget <= 0:
            return 0
        handle = self.cache.match_req(req)
        req.cached_len = req.device_len = handle.cached_len
        if self.chunk_for(req) == 0:
            return 0
        self.cache.lock(handle)
        chunk = self.chunk_for(req)  # locking made the matched pages unevictable
        if chunk == 0:
            self.cache.unlock(handle)
            return 0
        row = self.table.allocate()
        req.table_idx = row
        req.cache_handle = handle
        req.status = ReqStatus.RUNNING
        if handle.cached_len > 0:
            n = handle.cached_len
            self.table.token_pool[row, :n] = np.asarray(req.input_ids[:n], dtype=np.int32)
            self.table.write_slots(row, 0, handle.get_matched_indices())
        return chunk
