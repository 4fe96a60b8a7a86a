"""kvray.kvcache: the physical pool and the prefix caches."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.kvcache import (
    PREFIX_CACHES,
    MHAKVCache,
    create_kvcache_pool,
    create_prefix_cache,
    div_even,
    prefault,
)
from kvray.kvcache.mha_pool import zeroed
from kvray.kvcache.prefault import prefault_in_background
from kvray.kvcache.radix import RadixPrefixCache


def test_div_even_splits_replicates_or_refuses():
    assert div_even(8, 2) == 4
    assert div_even(3, 3, allow_replicate=True) == 1
    assert div_even(3, 9, allow_replicate=True) == 1  # TP 9 over 3 KV heads: replicate
    assert div_even(2, 4, allow_replicate=True) == 1
    with pytest.raises(ValueError, match="cannot be split"):
        div_even(3, 2, allow_replicate=True)
    with pytest.raises(ValueError, match="cannot be split"):
        div_even(2, 4)  # replication must be asked for
    with pytest.raises(ValueError):
        div_even(3, 6 + 1, allow_replicate=True)


def test_mha_pool_layout_views_and_store():
    pool = MHAKVCache(
        num_kv_heads=4,
        num_layers=3,
        head_dim=8,
        num_pages=5,
        page_size=4,
        dtype=torch.float32,
        device="cpu",
        tp_size=2,
    )
    assert pool.buffer_shape == (2, 3, 5, 4, 2, 8)
    assert pool.num_layers == 3 and pool.dtype == torch.float32
    assert pool.device == torch.device("cpu")
    k1 = pool.k_cache(1)
    assert k1.shape == (5, 4, 2, 8)
    # Views, not copies: they share the one buffer.
    assert k1.untyped_storage().data_ptr() == pool.v_cache(2).untyped_storage().data_ptr()
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    out_loc = torch.tensor([5, 6, 17], dtype=torch.int32)  # page 1 slots 1,2 and page 4 slot 1
    pool.store_kv(k, v, out_loc, layer_id=1)
    assert torch.equal(pool.k_cache(1)[1, 1], k[0])
    assert torch.equal(pool.k_cache(1)[1, 2], k[1])
    assert torch.equal(pool.v_cache(1)[4, 1], v[2])
    assert pool.k_cache(0).abs().sum() == 0 and pool.k_cache(2).abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_kernel_writes_each_row_to_its_slot(dtype):
    from kvray.kvcache import cpu_store

    pool = MHAKVCache(3, 2, 64, num_pages=6, page_size=16, dtype=dtype, device="cpu")
    # k and v as the model hands them over: views into one wider projection
    qkv = torch.randn(40, 9 * 64 + 2 * 3 * 64).to(dtype)
    k = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64)
    v = qkv[:, 12 * 64 :].view(40, 3, 64)
    loc = torch.randperm(96)[:40]  # distinct slots of the 96, scattered
    ref_k = pool.k_flat(1).clone().index_copy_(0, loc, k)
    ref_v = pool.v_flat(1).clone().index_copy_(0, loc, v)
    if not cpu_store.store(pool.k_flat(1), pool.v_flat(1), k, v, loc):
        pytest.skip("the store kernel cannot be built here")
    assert torch.equal(pool.k_flat(1), ref_k) and torch.equal(pool.v_flat(1), ref_v)
    assert pool.k_flat(0).abs().sum() == 0  # other layers untouched
    # A slot outside the pool is refused before anything is written.
    before = pool.k_flat(1).clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        pool.store_kv(k[:2], v[:2], torch.tensor([0, 96]), layer_id=1)
    assert torch.equal(pool.k_flat(1), before)
    # Inputs it does not serve (another dtype) fall back to index_copy_, converting.
    assert not cpu_store.store(pool.k_flat(0), pool.v_flat(0), k.double(), v.double(), loc)
    pool.store_kv(k.double(), v.double(), loc, layer_id=0)
    assert torch.equal(pool.k_flat(0)[loc], k)


def test_pool_replicates_kv_heads_and_adds_dummy_page():
    pool = create_kvcache_pool(
        num_kv_heads=3,
        num_layers=2,
        head_dim=4,
        num_pages=6,
        page_size=2,
        dtype=torch.bfloat16,
        device="cpu",
        tp_size=9,
    )
    assert pool.buffer_shape == (2, 2, 7, 2, 1, 4)  # 6 pages + the dummy page, 1 head
    with pytest.raises(ValueError):
        create_kvcache_pool(
            num_kv_heads=3,
            num_layers=2,
            head_dim=4,
            num_pages=6,
            page_size=2,
            dtype=torch.float32,
            device="cpu",
            tp_size=2,
        )


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _resident_bytes(address: int) -> int:
    """Rss of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_fresh_cpu_memory_is_zeros_not_yet_written():
    """`zeroed` takes fresh anonymous memory: 1 GiB of zeros that the process does not
    grow by until its pages are written (the pool then commits them off the step path)."""
    before = _rss_mib()
    buf = zeroed((2, 16, 2048, 16, 4, 64), torch.float32, "cpu")
    assert _rss_mib() - before < 64
    assert not buf[1, 7].any() and not buf[0, 15].any()  # (zero pages: read, not written)
    assert _rss_mib() - before < 64


def _gib_pool() -> MHAKVCache:
    """A 1 GiB float32 CPU pool: (2, 16 layers, 2048 pages, 16 slots, 4 heads, 64)."""
    return create_kvcache_pool(
        num_kv_heads=4,
        num_layers=16,
        head_dim=64,
        num_pages=2047,
        page_size=16,
        dtype=torch.float32,
        device="cpu",
    )


@pytest.mark.skipif(not prefault.supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)")
def test_a_cpu_pool_commits_its_memory_in_the_background_and_keeps_what_is_stored():
    """A 1 GiB CPU pool is usable at once; a background thread commits all of its memory
    (stores meanwhile land and stay), it still reads as zeros where nothing was stored,
    and a dropped pool's thread lets go of it."""
    pool = _gib_pool()
    assert pool.buffer_shape == (2, 16, 2048, 16, 4, 64)  # 1 GiB
    loc = torch.tensor([5, 700, 32767])
    kv = torch.randn(3, 4, 64)
    pool.store_kv(kv, -kv, loc, 3)
    thread = pool.prefault_thread
    assert thread is not None
    thread.join(120)
    assert not thread.is_alive()
    buffer = pool.k_flat(0)
    assert _resident_bytes(buffer.data_ptr()) >= 2**30
    k = pool.k_flat(3)
    assert torch.equal(k[loc], kv) and torch.equal(pool.v_flat(3)[loc], -kv)
    k[loc] = 0
    pool.v_flat(3)[loc] = 0
    assert not any(pool.k_flat(i).any() or pool.v_flat(i).any() for i in range(16))

    del pool, buffer, k
    gc.collect()
    again = _gib_pool()
    thread, address = again.prefault_thread, again.k_flat(0).data_ptr()
    del again
    gc.collect()
    assert thread is not None
    thread.join(120)
    with pytest.raises(AssertionError, match="no mapping"):
        _resident_bytes(address)  # the thread let go, and the memory went back


@pytest.mark.skipif(not prefault.supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)")
def test_the_prefault_thread_holds_the_pool_only_while_it_commits_a_chunk():
    """Between chunks nothing of the thread's keeps the buffer alive: dropped then, it is
    freed at once, and the thread ends at its next chunk without touching it."""
    buf = zeroed((4, 1024, 1024), torch.uint8, "cpu")
    alive = weakref.ref(buf)
    first_done, go_on = threading.Event(), threading.Event()

    def chunks() -> Iterator[list[tuple[int, int]]]:
        yield [(0, 2**20), (3 * 2**20 + 5, 4096)]  # (offsets need not be page-aligned)
        first_done.set()
        go_on.wait(60)
        yield [(2**20, 2**20)]

    thread = prefault_in_background(buf, chunks())
    assert thread is not None
    assert first_done.wait(60)
    assert _resident_bytes(buf.data_ptr()) >= 2**20 + 4096
    del buf
    gc.collect()
    assert alive() is None
    go_on.set()
    thread.join(60)
    assert not thread.is_alive()


def test_policies_are_registered_by_name():
    assert PREFIX_CACHES.names() == ["naive", "radix"]
    with pytest.raises(ValueError, match="unknown prefix cache"):
        create_prefix_cache("lru", 4)


def test_naive_never_matches_or_holds():
    cache = create_prefix_cache("naive", 4)
    prefix_len, handle = cache.insert_prefix(list(range(8)), np.arange(8, dtype=np.int32))
    assert prefix_len == 0 and handle.cached_len == 0
    assert cache.match_prefix(list(range(8))).cached_len == 0
    assert cache.size_info.total_size == 0


def _slots(first_page: int, n_pages: int, ps: int) -> np.ndarray:
    return np.arange(first_page * ps, (first_page + n_pages) * ps, dtype=np.int32)


def test_radix_match_insert_split_and_alignment():
    ps = 4
    cache = RadixPrefixCache(ps)
    ids = list(range(100, 113))  # 13 tokens: only 12 are registered
    prefix_len, h = cache.insert_prefix(ids, _slots(0, 4, ps))
    assert (prefix_len, h.cached_len) == (0, 12)
    assert np.array_equal(h.get_matched_indices(), np.arange(12))
    # A prompt diverging in the third page matches two pages and splits the node.
    other = ids[:9] + [7, 7, 7]
    m = cache.match_prefix(other)
    assert m.cached_len == 8
    assert np.array_equal(m.get_matched_indices(), np.arange(8))
    cache.check_integrity()
    # Inserting it shares the first 8 and adds its own third page.
    prefix_len, h2 = cache.insert_prefix(other, np.concatenate([np.arange(8), _slots(5, 1, ps)]))
    assert (prefix_len, h2.cached_len) == (8, 12)
    assert cache.size_info.evictable_size == 16
    cache.check_integrity()
    # A match shorter than one page matches nothing.
    assert cache.match_prefix(ids[:3]).cached_len == 0


def test_radix_locks_protect_and_eviction_is_lru_over_leaves():
    ps = 2
    cache = RadixPrefixCache(ps)
    _, a = cache.insert_prefix([1, 2, 3, 4], _slots(0, 2, ps))
    # b shares a's first page; its own page is slots 4, 5.
    cache.insert_prefix([1, 2, 5, 6], np.array([0, 1, 4, 5], dtype=np.int32))
    cache.insert_prefix([9, 9], _slots(3, 1, ps))
    assert cache.size_info.evictable_size == 8
    cache.lock_handle(a)
    assert cache.size_info.protected_size == 4 and cache.size_info.evictable_size == 4
    cache.match_prefix([9, 9])  # c is now the most recently used
    evicted = cache.evict(2)
    assert sorted(evicted.tolist()) == [4, 5]  # b's leaf page: LRU and unlocked
    with pytest.raises(RuntimeError):
        cache.evict(4)  # only c's page (2 slots) is evictable
    cache.lock_handle(a, unlock=True)
    evicted = cache.evict(6)
    assert sorted(evicted.tolist()) == [0, 1, 2, 3, 6, 7]
    assert cache.size_info.total_size == 0
    cache.check_integrity()


@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
            st.lists(st.integers(0, 2), min_size=0, max_size=14),
            st.integers(0, 40),
        ),
        max_size=40,
    ),
)
def test_radix_property_against_a_dict_model(ps, ops):
    """The tree answers like a set of registered page-aligned prefixes, and its sizes,
    locks and eviction stay consistent under random operation sequences."""
    cache = RadixPrefixCache(ps)
    next_page = 0
    held: dict[tuple, int] = {}  # registered token prefix (aligned) -> slot of its last token
    locks: list = []
    for op, ids, n in ops:
        aligned = len(ids) // ps * ps
        if op == "insert":
            slots = _slots(next_page, max(1, aligned // ps), ps)[:aligned]
            next_page += max(1, aligned // ps)
            before = cache.match_prefix(ids).cached_len
            prefix_len, h = cache.insert_prefix(ids, slots)
            assert prefix_len == before and h.cached_len == aligned
            got = h.get_matched_indices()
            assert np.array_equal(got[prefix_len:], slots[prefix_len:aligned])
            for end in range(ps, aligned + 1, ps):
                held.setdefault(tuple(ids[:end]), int(got[end - 1]))
        elif op == "match":
            h = cache.match_prefix(ids)
            expect = max([e for e in range(0, aligned + 1, ps) if e == 0 or tuple(ids[:e]) in held])
            assert h.cached_len == expect
            if expect:
                assert int(h.get_matched_indices()[-1]) == held[tuple(ids[:expect])]
        elif op == "lock":
            h = cache.match_prefix(ids)
            cache.lock_handle(h)
            locks.append((h, h.get_matched_indices().copy()))
        elif op == "unlock" and locks:
            h, _ = locks.pop(n % len(locks))
            cache.lock_handle(h, unlock=True)
        elif op == "evict":
            want = min(n, cache.size_info.evictable_size)
            evicted = cache.evict(want)
            assert len(evicted) >= want
            gone = set(evicted.tolist())
            held = {k: s for k, s in held.items() if s not in gone}
        cache.check_integrity()
        for h, slots in locks:  # a locked prefix is never evicted or moved
            assert np.array_equal(h.get_matched_indices(), slots)
            assert cache.match_prefix(_ids_of(h)).cached_len >= h.cached_len
    for h, _ in locks:
        cache.lock_handle(h, unlock=True)
    cache.evict(cache.size_info.evictable_size)
    assert cache.size_info.total_size == 0 and len(cache.root.children) == 0


def _ids_of(handle) -> list[int]:
    """The token ids on the path of a handle (root to its node)."""
    parts = []
    node = handle.node
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for key in reversed(parts) for t in key]


def test_digest_names_every_cached_page_and_followers_catch_up():
    from kvray.kvcache.digest import DigestFollower, PrefixDigest, page_keys

    ps = 4
    cache = RadixPrefixCache(ps)
    follower, late = DigestFollower(), DigestFollower()
    follower.apply(cache.digest.since(follower.epoch, follower.seq))  # a snapshot: empty
    a = list(range(100, 113))  # 3 whole pages + 1 token
    b = a[:8] + [7, 7, 7, 7, 9]  # shares 2 pages with a, then its own
    cache.insert_prefix(a, np.arange(len(a), dtype=np.int32) + 16)
    cache.insert_prefix(b, np.arange(len(b), dtype=np.int32) + 64)
    cache.check_integrity()  # the tree's page keys are its digest
    keys_a, keys_b = page_keys(a, ps), page_keys(b, ps)
    assert keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]
    assert cache.digest.keys == set(keys_a) | set(keys_b)
    follower.apply(cache.digest.since(follower.epoch, follower.seq))
    assert follower.matched_pages(keys_a) == 3 and follower.matched_pages(keys_b) == 3
    assert follower.matched_pages(page_keys([1, 2, 3, 4] + a, ps)) == 0  # prefixes only
    # evict a's own page (the least recently used leaf): followers see it go
    cache.evict(ps)
    cache.check_integrity()
    delta = cache.digest.since(follower.epoch, follower.seq)
    assert not delta.snapshot and delta.removed == [keys_a[2]] and not delta.added
    follower.apply(delta)
    assert follower.matched_pages(keys_a) == 2 and follower.keys == cache.digest.keys
    # a follower of another epoch (or too far behind a bounded log) gets a snapshot
    late.apply(cache.digest.since(late.epoch, 0))
    assert late.keys == cache.digest.keys
    small = PrefixDigest(max_log=2)
    small.add([1, 2, 3])
    assert small.since(small.epoch, 0).snapshot and small.since(small.epoch, 3).added == []
    small.remove([2])
    small.add([2])  # removed then added again: its net change is "added"
    delta = small.since(small.epoch, 3)
    assert (delta.added, delta.removed) == ([2], [])
