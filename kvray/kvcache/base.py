"""Abstract interfaces of the KV room: the physical pool and the prefix cache.

`BaseKVCachePool` stores numbers and knows nothing of requests. `BasePrefixCache` stores
which physical token slots hold the K/V of which token prefix and knows nothing of tensors'
values. Slot indices are int32 numpy arrays of raw token slots (page start + offset).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.kvcache.digest import PrefixDigest


def div_even(a: int, b: int, allow_replicate: bool = False) -> int:
    """Split `a` items evenly over `b` ranks.

    With `allow_replicate`, `b > a` is allowed when `b % a == 0`: each rank then holds one
    item, shared by `b // a` ranks (KV heads replicated across TP ranks).
    """
    if a <= 0 or b <= 0:
        raise ValueError(f"div_even needs positive sizes, got {a} and {b}")
    if a % b == 0:
        return a // b
    if allow_replicate and b > a and b % a == 0:
        return 1
    if allow_replicate:
        raise ValueError(
            f"{a} cannot be split over {b} ranks: need {a} % {b} == 0, "
            f"or {b} > {a} with {b} % {a} == 0 (replication)"
        )
    raise ValueError(f"{a} cannot be split evenly over {b} ranks")


class BaseKVCachePool(ABC):
    @abstractmethod
    def k_cache(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


class BaseCacheHandle(ABC):
    """A matched prefix: `cached_len` tokens whose K/V already sits in the pool."""

    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> np.ndarray:
        """The token slots of the matched prefix, int32 of length `cached_len`."""


@dataclass(frozen=True)
class SizeInfo:
    """Token slots held by the prefix cache: evictable (unlocked) and protected (locked)."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class BasePrefixCache(ABC):
    """Which token prefixes already have K/V, and where. Sizes are in token slots."""

    shares_prefixes: bool = True  # False for a policy that never matches

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # The whole-page prefixes held, for prefix-aware routing (None: never matches).
        self.digest: PrefixDigest | None = None

    @abstractmethod
    def match_prefix(self, input_ids: Sequence[int]) -> BaseCacheHandle:
        """Longest cached prefix of `input_ids`, aligned down to page_size. Refreshes the
        matched path's LRU time and may split a node at the match boundary (the cached
        content is unchanged; only the tree's shape is)."""

    @abstractmethod
    def insert_prefix(
        self, input_ids: Sequence[int], indices: np.ndarray
    ) -> tuple[int, BaseCacheHandle]:
        """Register `input_ids[:L]` -> `indices[:L]`, L aligned down to page_size. Returns
        the length that was already cached (those of `indices` are now duplicates the
        caller owns) and a handle covering all L tokens."""

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Add (or remove) one reference on every node from the handle up to the root."""

    @abstractmethod
    def evict(self, size: int) -> np.ndarray:
        """Remove at least `size` unlocked token slots, least recently used leaves first;
        returns the removed slots (whole pages). Raises if not enough are evictable."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @property
    def evictable_size(self) -> int:
        return self.size_info.evictable_size

    @abstractmethod
    def all_indices(self) -> np.ndarray:
        """Every slot the cache holds (for integrity checks)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's internal bookkeeping is consistent."""
