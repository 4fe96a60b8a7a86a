"""WHAT is stored WHERE: the physical KV pool and the prefix caches (no scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvray.kvcache.base import (
    BaseCacheHandle,
    BaseKVCachePool,
    BasePrefixCache,
    SizeInfo,
    div_even,
)
from kvray.kvcache.mha_pool import MHAKVCache
from kvray.registry import Registry

PREFIX_CACHES: Registry[Callable[[int], BasePrefixCache]] = Registry("prefix cache")


@PREFIX_CACHES.register("naive")
def create_naive_cache(page_size: int) -> BasePrefixCache:
    from kvray.kvcache.naive import NaivePrefixCache

    return NaivePrefixCache(page_size)


@PREFIX_CACHES.register("radix")
def create_radix_cache(page_size: int) -> BasePrefixCache:
    from kvray.kvcache.radix import RadixPrefixCache

    return RadixPrefixCache(page_size)


def create_prefix_cache(policy: str, page_size: int) -> BasePrefixCache:
    return PREFIX_CACHES.get(policy)(page_size)


def create_kvcache_pool(*, num_pages: int, **pool: Any) -> MHAKVCache:
    """A pool for `num_pages` schedulable pages plus the dummy page (the last one), which
    padded batches write to; `pool` are MHAKVCache's other (keyword) arguments."""
    return MHAKVCache(num_pages=num_pages + 1, **pool)


__all__ = [
    "BaseCacheHandle",
    "BaseKVCachePool",
    "BasePrefixCache",
    "MHAKVCache",
    "PREFIX_CACHES",
    "SizeInfo",
    "create_kvcache_pool",
    "create_prefix_cache",
    "div_even",
]
