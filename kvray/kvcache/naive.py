"""The "naive" prefix cache: never matches, never holds a page."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvray.kvcache.base import BaseCacheHandle, BasePrefixCache, SizeInfo

_EMPTY = np.zeros(0, dtype=np.int32)


class NaiveCacheHandle(BaseCacheHandle):
    cached_len = 0

    def get_matched_indices(self) -> np.ndarray:
        return _EMPTY


class NaivePrefixCache(BasePrefixCache):
    shares_prefixes = False
    _HANDLE = NaiveCacheHandle()

    def match_prefix(self, input_ids: Sequence[int]) -> BaseCacheHandle:
        return self._HANDLE

    def insert_prefix(
        self, input_ids: Sequence[int], indices: np.ndarray
    ) -> tuple[int, BaseCacheHandle]:
        return 0, self._HANDLE

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        pass

    def evict(self, size: int) -> np.ndarray:
        if size > 0:
            raise RuntimeError(f"naive prefix cache holds nothing to evict (asked {size})")
        return _EMPTY

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    @property
    def evictable_size(self) -> int:
        return 0

    def all_indices(self) -> np.ndarray:
        return _EMPTY

    def check_integrity(self) -> None:
        pass
