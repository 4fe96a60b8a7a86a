"""CacheManager: hands out KV pages and moves them between requests and the prefix cache.

Every schedulable page is, at any moment, in exactly one of four places:
  1. `free_slots` (the page's start slot is on the free stack),
  2. the prefix cache (a tree node holds it; locked or evictable),
  3. private to one live request: the pages of its page_table row from
     `cache_handle.cached_len` up to `alloc_len(req)`,
  4. reserved by an import in progress (`ImportLease`: K/V of a prefix copied in from
     another engine, entering the prefix cache once written).
`check_integrity` asserts this partition. The dummy page (index num_pages) is never
handed out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvray.core import Req, div_ceil
from kvray.kvcache.base import BaseCacheHandle, BasePrefixCache
from kvray.scheduler.table import TableManager


@dataclass(eq=False)
class ExportLease:
    """Cached pages being copied out to another engine: locked in the tree until `end`."""

    handle: BaseCacheHandle
    pages: list[int]  # page indices of tokens [start, tokens) of the prefix
    tokens: int  # the prefix's cached length
    uid: int = field(default_factory=itertools.count().__next__)


@dataclass(eq=False)
class ImportLease:
    """A prefix whose K/V is being copied in: the locally cached part stays locked, and
    `pages` (once reserved) hold the rest until it enters the tree."""

    handle: BaseCacheHandle  # the locally cached prefix, locked
    start: int  # its length: the import continues from here
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # starts
    uid: int = field(default_factory=itertools.count().__next__)


def alloc_len(req: Req, page_size: int) -> int:
    """Length of the row prefix that has pages. Between steps, positions up to cached_len
    were allocated by earlier steps; the slot reserved by complete_one is not yet."""
    return div_ceil(req.cached_len, page_size) * page_size


class CacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        table: TableManager,
        prefix_cache: BasePrefixCache,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.table = table
        self.page_table = table.page_table
        self.prefix_cache = prefix_cache
        # A stack of free page-start slots: entries [0, _num_free) are free, and allocation
        # takes from the top (LIFO: recently freed pages are reused first).
        self._free_stack = np.arange(num_pages, dtype=np.int32) * page_size
        self._num_free = num_pages
        self._offsets = np.arange(page_size, dtype=np.int32)
        self.evicted_pages = 0  # monotonic counter
        self._importing: dict[int, np.ndarray] = {}  # ImportLease.uid -> its reserved pages
        self.leases = 0  # export and import leases open (each locks a prefix)

    # -- pages ------------------------------------------------------------------------------

    @property
    def free_slots(self) -> np.ndarray:
        """Start slot of every free page."""
        return self._free_stack[: self._num_free]

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def available_size(self) -> int:
        """Token slots that could be handed out now: free pages plus evictable cache."""
        return self._num_free * self.page_size + self.prefix_cache.evictable_size

    @property
    def available_pages(self) -> int:
        return self._num_free + self.prefix_cache.evictable_size // self.page_size

    def _page_to_token(self, pages: np.ndarray) -> np.ndarray:
        """Page-start slots -> every token slot of those pages, in order."""
        if self.page_size == 1:
            return pages
        return (pages[:, None] + self._offsets).reshape(-1)

    def _allocate(self, num_pages: int) -> np.ndarray:
        if num_pages > self._num_free:
            evicted = self.prefix_cache.evict((num_pages - self._num_free) * self.page_size)
            self.evicted_pages += len(evicted) // self.page_size
            self._free(evicted)
        if num_pages > self._num_free:
            raise RuntimeError(f"out of KV pages: need {num_pages}, have {self._num_free}")
        start = self._num_free - num_pages
        pages = self._free_stack[start : self._num_free].copy()
        self._num_free = start
        return pages

    def _free(self, slots: np.ndarray) -> None:
        """Return whole pages, given as all their token slots (page-aligned span)."""
        if len(slots) == 0:
            return
        pages = slots[:: self.page_size]
        n = len(pages)
        self._free_stack[self._num_free : self._num_free + n] = pages
        self._num_free += n

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Give every request pages covering [cached_len, device_len) in its row."""
        ps = self.page_size
        rows: list[int] = []
        page_idx: list[int] = []
        for req in reqs:
            first_page = -(-req.cached_len // ps)
            last_page = -(-req.device_len // ps)
            for p in range(first_page, last_page):
                rows.append(req.table_idx)
                page_idx.append(p)
        if not rows:
            return
        pages = self._allocate(len(rows))
        if ps == 1:
            self.page_table[rows, page_idx] = pages
        else:
            cols = (np.asarray(page_idx, dtype=np.int32) * ps)[:, None] + self._offsets
            self.page_table[np.asarray(rows)[:, None], cols] = pages[:, None] + self._offsets

    def shrink(self, req: Req, cached_len: int) -> None:
        """Free the pages a running request holds past what `cached_len` needs (its
        rejected drafts' pages), before its cached_len drops to that."""
        ps = self.page_size
        end = alloc_len(req, ps)
        keep = div_ceil(cached_len, ps) * ps
        if keep < end:
            self._free(self.page_table[req.table_idx, keep:end].copy())

    # -- prefixes ---------------------------------------------------------------------------

    def match_req(self, req: Req) -> BaseCacheHandle:
        """Match all but the last known token: its logits are needed to sample the next."""
        assert len(req.input_ids) > 0
        return self.prefix_cache.match_prefix(req.input_ids[: len(req.input_ids) - 1])

    def lock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Register the request's computed prefix and settle its pages.

        The row splits into regions (a = old handle's length, b = what the cache already
        held, c = new handle's length, d = alloc_len):
            [0, a)  matched earlier, protected by the old handle  -> unlocked
            [a, b)  computed here but already cached by another request -> our copy freed
                    (a live request's row is re-pointed at the cached copy)
            [b, c)  newly registered: now owned by the cache
            [c, d)  the unaligned tail (and positions whose token is still unknown):
                    freed if finished, else stays private
        """
        row = req.table_idx
        known = min(req.cached_len, len(req.input_ids))
        slots = self.page_table[row, :known]
        old = req.cache_handle
        assert old is not None
        prefix_len, new = self.prefix_cache.insert_prefix(req.input_ids[:known], slots)
        a, c = old.cached_len, new.cached_len
        if prefix_len > a:
            self._free(slots[a:prefix_len].copy())
            if not finished:
                self.table.write_slots(row, a, new.get_matched_indices()[a:prefix_len])
        if finished:
            self._free(self.page_table[row, c : alloc_len(req, self.page_size)].copy())
            self.unlock(old)
            req.cache_handle = None
        else:
            self.lock(new)
            self.unlock(old)
            req.cache_handle = new

    # -- prefixes shared between engines (kvray.cluster: export on one, import on another) --

    def lease_export(self, input_ids: Sequence[int], start: int) -> ExportLease | None:
        """Lock the cached prefix of `input_ids` for copying out its pages from token
        `start` (a page boundary) on; None if it holds no whole page past `start`."""
        handle = self.prefix_cache.match_prefix(input_ids)
        ps = self.page_size
        if start % ps or handle.cached_len - start < ps:
            return None
        self.lock(handle)
        self.leases += 1
        slots = handle.get_matched_indices()[start : handle.cached_len : ps]
        return ExportLease(handle, (slots // ps).tolist(), handle.cached_len)

    def end_export(self, lease: ExportLease) -> None:
        self.unlock(lease.handle)
        self.leases -= 1

    def lease_import(self, input_ids: Sequence[int]) -> ImportLease:
        """Lock the locally cached prefix of `input_ids`, which an import extends."""
        handle = self.prefix_cache.match_prefix(input_ids)
        self.lock(handle)
        self.leases += 1
        return ImportLease(handle, handle.cached_len)

    def reserve_import(self, lease: ImportLease, num_pages: int) -> list[int]:
        """Pages for the imported K/V (evicting if need be; raises if there are not
        enough); returns their page indices."""
        pages = self._allocate(num_pages)
        lease.pages = pages
        self._importing[lease.uid] = pages
        return [int(p) for p in pages // self.page_size]

    def end_import(self, lease: ImportLease, input_ids: Sequence[int], written: bool) -> int:
        """Settle an import: if its pages were `written`, the prefix they extend enters the
        tree (pages the tree meanwhile got elsewhere are freed), else they are freed.
        Unlocks the local prefix. Returns the tokens added to the cache."""
        pages = self._importing.pop(lease.uid, None)
        added = 0
        if pages is not None and len(pages):
            new = self._page_to_token(pages)
            if written:
                end = lease.start + len(new)
                indices = np.concatenate([lease.handle.get_matched_indices(), new])
                prefix_len, _ = self.prefix_cache.insert_prefix(input_ids[:end], indices)
                dup = max(prefix_len - lease.start, 0)
                self._free(new[:dup].copy())
                added = end - max(prefix_len, lease.start)
            else:
                self._free(new)
        self.unlock(lease.handle)
        self.leases -= 1
        return added

    def flush(self) -> None:
        """Drop every unlocked prefix from the cache (their pages become free)."""
        self._free(self.prefix_cache.evict(self.prefix_cache.size_info.evictable_size))

    # -- invariants -------------------------------------------------------------------------

    def check_integrity(self, live: Iterable[Req]) -> None:
        """Assert the page partition described in the module docstring."""
        ps = self.page_size
        self.prefix_cache.check_integrity()
        owned = [self.free_slots, self.prefix_cache.all_indices()[::ps], *self._importing.values()]
        for req in live:
            handle = req.cache_handle
            assert handle is not None, f"live request {req.rid} holds no cache handle"
            row = self.page_table[req.table_idx]
            matched = handle.get_matched_indices()
            assert np.array_equal(row[: handle.cached_len], matched), (
                f"request {req.rid}: row does not point at its locked prefix"
            )
            owned.append(row[handle.cached_len : alloc_len(req, ps) : ps])
        pages = np.concatenate(owned)
        assert (pages % ps == 0).all(), "a page start is not page aligned"
        assert len(pages) == self.num_pages, (
            f"page accounting: {len(pages)} pages accounted for, pool has {self.num_pages}"
        )
        assert len(np.unique(pages)) == len(pages), "a page is owned twice"
        assert pages.max(initial=0) < self.num_pages * ps, "the dummy page was handed out"
