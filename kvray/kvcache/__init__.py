"""WHAT is stored WHERE: the physical KV pool and the prefix caches (no scheduling)."""

from __future__ import annotations

from collections.abc import Callable

import torch

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


def create_kvcache_pool(
    *,
    num_kv_heads: int,
    num_layers: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int,
) -> MHAKVCache:
    """A pool for `num_pages` schedulable pages plus the dummy page (the last one)."""
    return MHAKVCache(
        num_kv_heads=num_kv_heads,
        num_layers=num_layers,
        head_dim=head_dim,
        num_pages=num_pages + 1,  # +1: the dummy page padded batches write to
        page_size=page_size,
        dtype=dtype,
        device=device,
        tp_size=tp_size,
    )


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
