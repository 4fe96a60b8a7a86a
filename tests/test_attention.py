"""The torch attention backend against dense causal attention, over a scattered paged pool."""

from __future__ import annotations

import math

import pytest
import torch

from kvray.attention import (
    ATTENTION_BACKENDS,
    AttnMetadata,
    backend_names,
    create_attention_backend,
    resolve_backend_name,
)
from kvray.kvcache import create_kvcache_pool

HEAD_DIM = 8
UNSET = 10**9  # page-table entries nobody wrote: must never be read


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Dense attention of queries at positions start.. over keys 0..len(k)-1, causal."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


class Pool:
    """A KV pool plus a page table whose rows get pages from a shuffled free list."""

    def __init__(self, page_size: int, kv_heads: int, dtype: torch.dtype, seed: int) -> None:
        self.page_size = page_size
        self.cache = create_kvcache_pool(
            num_kv_heads=kv_heads,
            num_layers=2,
            head_dim=HEAD_DIM,
            num_pages=256 // page_size,
            page_size=page_size,
            dtype=dtype,
            device="cpu",
            tp_size=1,
        )
        gen = torch.Generator().manual_seed(seed)
        self.free_pages = torch.randperm(256 // page_size, generator=gen).tolist()
        self.dummy_slot = (self.cache.num_pages - 1) * page_size
        self.table = torch.full((8, 128), UNSET, dtype=torch.int32)

    def allocate(self, row: int, length: int) -> None:
        for pos in range(0, length, self.page_size):
            page = self.free_pages.pop()
            n = min(self.page_size, length - pos)
            self.table[row, pos : pos + n] = page * self.page_size + torch.arange(n)


def _run_step(backend, pool: Pool, reqs, q_all, k_all, v_all, layer: int) -> None:
    """One step over `reqs` = [(row, start, extend)], checked against the reference."""
    rows = [r for r, _, _ in reqs]
    meta = AttnMetadata.build(
        pool.table, rows, [s for _, s, _ in reqs], [e for _, _, e in reqs], pool.dummy_slot
    )
    backend.prepare(meta)
    take = [(r, slice(s, s + e)) for r, s, e in reqs]
    q = torch.cat([q_all[r][sl] for r, sl in take])
    k = torch.cat([k_all[r][sl] for r, sl in take])
    v = torch.cat([v_all[r][sl] for r, sl in take])
    out = backend.forward(q, k, v, layer)
    expected = torch.cat(
        [
            _reference(q_all[r][s : s + e], k_all[r][: s + e], v_all[r][: s + e], s)
            for r, s, e in reqs
        ]
    )
    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    assert out.shape == (q.shape[0], q.shape[1] * HEAD_DIM)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# (length already in the cache from an earlier step, tokens computed now)
MIXED = [
    (0, 7),  # pure prefill
    (5, 9),  # prefix-cached / second chunk, not page aligned
    (12, 1),  # decode
    (16, 16),  # chunked prefill, page aligned
    (33, 1),  # decode, longer context
    (0, 1),  # one-token prompt
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (2, 2), (4, 1)])
def test_mixed_batch_matches_dense(page_size: int, q_heads: int, kv_heads: int) -> None:
    torch.manual_seed(page_size * 10 + q_heads + kv_heads)
    dtype = torch.float32
    pool = Pool(page_size, kv_heads, dtype, seed=page_size)
    backend = create_attention_backend("torch", pool.cache, q_heads, HEAD_DIM, HEAD_DIM**-0.5)
    total = [c + n for c, n in MIXED]
    q_all = [torch.randn(n, q_heads, HEAD_DIM, dtype=dtype) for n in total]
    k_all = [torch.randn(n, kv_heads, HEAD_DIM, dtype=dtype) for n in total]
    v_all = [torch.randn(n, kv_heads, HEAD_DIM, dtype=dtype) for n in total]
    for row, n in enumerate(total):
        pool.allocate(row, n)
    for layer in range(2):  # layers share slots but not storage
        # Step 1 writes (and checks) every cached prefix as one prefill batch ...
        _run_step(
            backend,
            pool,
            [(r, 0, c) for r, (c, _) in enumerate(MIXED) if c],
            q_all,
            k_all,
            v_all,
            layer,
        )
        # ... step 2 computes the rest of every request, in a shuffled batch order.
        step2 = [(r, c, n) for r, (c, n) in enumerate(MIXED)]
        order = torch.randperm(len(step2)).tolist()
        _run_step(backend, pool, [step2[i] for i in order], q_all, k_all, v_all, layer)


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_by_token_decode_bfloat16(page_size: int) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    pool = Pool(page_size, 2, dtype, seed=1)
    backend = create_attention_backend("auto", pool.cache, 4, HEAD_DIM, HEAD_DIM**-0.5)
    lengths = [20, 3]
    q_all = [torch.randn(n, 4, HEAD_DIM, dtype=dtype) for n in lengths]
    k_all = [torch.randn(n, 2, HEAD_DIM, dtype=dtype) for n in lengths]
    v_all = [torch.randn(n, 2, HEAD_DIM, dtype=dtype) for n in lengths]
    for row, n in enumerate(lengths):
        pool.allocate(row, n)
    _run_step(backend, pool, [(0, 0, 10), (1, 0, 2)], q_all, k_all, v_all, 0)
    _run_step(backend, pool, [(0, 10, 1), (1, 2, 1)], q_all, k_all, v_all, 0)
    for pos in range(11, 20):
        _run_step(backend, pool, [(0, pos, 1)], q_all, k_all, v_all, 0)


def test_metadata_build() -> None:
    pool = Pool(4, 2, torch.float32, seed=3)
    pool.allocate(2, 6)
    pool.allocate(5, 3)
    meta = AttnMetadata.build(pool.table, [5, 2], [1, 4], [2, 2], pad_slot=pool.dummy_slot)
    assert meta.positions.tolist() == [1, 2, 4, 5]
    assert meta.out_loc.tolist() == pool.table[[5, 5, 2, 2], [1, 2, 4, 5]].tolist()
    assert meta.seq_lens_q.tolist() == [2, 2]
    assert meta.seq_lens_k.tolist() == [3, 6]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 4]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (2, 6)
    assert meta.page_table.shape == (2, 6) and meta.page_table.dtype == torch.int64
    assert meta.page_table[0, 3:].tolist() == [pool.dummy_slot] * 3  # masked padding
    assert meta.page_table[1].tolist() == pool.table[2, :6].tolist()
    with pytest.raises(ValueError):
        AttnMetadata.build(pool.table, [2], [0], [0])


def test_registry_and_auto() -> None:
    pool = Pool(16, 2, torch.float32, seed=0)
    assert set(ATTENTION_BACKENDS.names()) == {"torch", "flash_attn"}
    assert backend_names()[0] == "auto"
    assert resolve_backend_name("auto", pool.cache) == "torch"  # CPU pool
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", pool.cache, 4, HEAD_DIM, 1.0)
    # No flash-attn here, and page_size 16 would be refused anyway.
    with pytest.raises((ImportError, ValueError)):
        create_attention_backend("flash_attn", pool.cache, 4, HEAD_DIM, 1.0)
    backend = create_attention_backend("torch", pool.cache, 4, HEAD_DIM, 1.0)
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(
            torch.zeros(1, 4, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), 0
        )
