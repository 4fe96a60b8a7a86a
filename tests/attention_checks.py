"""Paged-attention checks shared by the backend test modules: a KV pool whose pages are
handed out from a shuffled free list, and one step of a backend checked against dense
causal attention."""

from __future__ import annotations

import itertools
import math

import torch

from kvray.attention import AttnMetadata
from kvray.kvcache import create_kvcache_pool

HEAD_DIM = 8
# (length already in the cache from an earlier step, tokens computed now)
MIXED = [
    (0, 7),  # pure prefill
    (5, 9),  # prefix-cached / second chunk, not page aligned
    (12, 1),  # decode
    (16, 16),  # chunked prefill, page aligned
    (33, 1),  # decode, longer context
    (0, 1),  # one-token prompt
]
UNSET = 10**9  # page-table entries nobody wrote: must never be read


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Dense attention of queries at positions start.. over keys 0..len(k)-1, causal."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


class Pool:
    """A KV pool plus a page table whose rows get pages from a shuffled free list."""

    def __init__(
        self,
        page_size: int,
        kv_heads: int,
        dtype: torch.dtype,
        seed: int,
        head_dim: int = HEAD_DIM,
        num_slots: int = 256,
        width: int = 128,
    ) -> None:
        """`num_slots` usable slots (plus the dummy page); rows of `width` positions."""
        self.page_size = page_size
        self.cache = create_kvcache_pool(
            num_kv_heads=kv_heads,
            num_layers=2,
            head_dim=head_dim,
            num_pages=num_slots // page_size + 1,
            page_size=page_size,
            dtype=dtype,
            device="cpu",
            tp_size=1,
        )
        gen = torch.Generator().manual_seed(seed)
        self.free_pages = torch.randperm(num_slots // page_size, generator=gen).tolist()
        self.dummy_slot = (self.cache.num_pages - 1) * page_size
        self.table = torch.full((8, width), UNSET, dtype=torch.int32)

    def allocate(self, row: int, length: int) -> None:
        for pos in range(0, length, self.page_size):
            page = self.free_pages.pop()
            n = min(self.page_size, length - pos)
            self.table[row, pos : pos + n] = page * self.page_size + torch.arange(n)


def run_step(backend, pool: Pool, reqs, q_all, k_all, v_all, layer: int) -> None:
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
            dense_reference(q_all[r][s : s + e], k_all[r][: s + e], v_all[r][: s + e], s)
            for r, s, e in reqs
        ]
    )
    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    assert out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def two_prompt_logits(model) -> torch.Tensor:
    """A loaded model's logits for every position of two short prompts (11 and 7 tokens)
    computed as one step over a fresh pool, through the `auto` attention backend."""
    from kvray.attention import create_attention_backend

    cfg = model.config
    cache = create_kvcache_pool(
        num_kv_heads=cfg.num_kv_heads,
        num_layers=cfg.num_layers,
        head_dim=cfg.head_dim,
        num_pages=4,
        page_size=16,
        dtype=model.dtype,
        device="cpu",
        tp_size=1,
    )
    attn = create_attention_backend(
        "auto", cache, model.num_q_heads_local, cfg.head_dim, model.attn_scale
    )
    table = torch.arange(64).reshape(2, 32)
    ids = [list(range(3, 14)), list(range(40, 47))]
    meta = AttnMetadata.build(table, [0, 1], [0, 0], [len(i) for i in ids], 64)
    attn.prepare(meta)
    flat = torch.tensor([t for i in ids for t in i])
    return model(flat, meta.positions, attn, torch.arange(len(flat)))


def scattered_requests(contexts, news, kv_heads, group, head_dim, page_size, dtype, seed):
    """A pool whose pages are scattered, holding each request's context (cached prefix
    `contexts[i]` + new tokens `news[i]`) in `dtype`; the step's queries for the new tokens;
    and the `cpu_paged.Extends` describing them. Returns (q, k_pool, v_pool, each request's
    slots, each request's first row in q, extends)."""
    from kvray.attention import cpu_paged

    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(contexts, news, strict=True)]
    pages_per = [-(-t // page_size) for t in totals]
    num_pages = sum(pages_per) + 3
    shape = (num_pages * page_size, kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_pages, generator=gen).tolist()
    slots = []
    for total, n in zip(totals, pages_per, strict=True):
        pages = torch.tensor([free.pop() for _ in range(n)])
        slots.append((pages[:, None] * page_size + torch.arange(page_size)).flatten()[:total])
    T = sum(news)
    # q as the model hands it over: a view into a wider projection (rows not contiguous)
    qkv = torch.randn(T, (kv_heads * group + 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : kv_heads * group * head_dim].view(T, kv_heads * group, head_dim)
    starts = [sum(news[:i]) for i in range(len(news))]
    extends = cpu_paged.Extends(
        slots=torch.cat(slots),
        k_start=torch.tensor([0, *itertools.accumulate(totals)]),
        q_start=torch.tensor(starts),
        q_len=torch.tensor(news),
    )
    return q, k_pool, v_pool, slots, starts, extends
