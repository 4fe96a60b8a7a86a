"""Paged attention in Triton: K/V are read in place from the pool through the page table.

The pool of one layer is `[num_slots, local_kv_heads, head_dim]` (`MHAKVCache.k_flat`), and
a request's page-table row holds the raw slot of each of its positions (pages are runs of
slots, so any page size works without the kernel knowing it). K/V rows are gathered by
slot; nothing is copied into a padded buffer first.

One kernel serves both kinds of request. A program owns one KV head of one request and a
block of query rows: (query token, query head of that KV head's group) pairs, so each K/V
row is loaded once for the whole GQA group (replicated KV heads under wide TP included).
It attends causally (a query at position p sees keys 0..p of its own request, whether
cached earlier or stored this step: the caller stores this step's K/V first) with an online
softmax over blocks of keys.

    paged_decode(...)   one query token per request; each (request, KV head) may be cut
                        into `num_splits` key ranges ("flash decoding") whose partial
                        results a second kernel merges by their log-sum-exp
    paged_extend(...)   several query tokens per request (prefill, a chunk of one, or a
                        prompt after a cached prefix)

Both take the `AttnMetadata` tensors of the whole batch plus `req_idx`, the batch indices
of the requests the call serves. Scores, softmax and the weighted sum accumulate in float32
for any storage dtype; float32 inputs multiply in IEEE float32 (never TF32), so float32
runs stay an exact-reference path.

On CPUs these kernels run only under the Triton interpreter (`TRITON_INTERPRET=1`, set
before this module is imported): that is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# tl.dot's smallest block dimension: query-row and head_dim blocks are padded to it.
_MIN_DOT = 16
# Query rows (token x head pairs) per program for extends, and keys per block.
_EXTEND_ROWS = 64
_BLOCK_N = 64
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Most key ranges one decode may be split into (the merge kernel reads them in one block).
MAX_SPLITS = 16


def interpreted() -> bool:
    """Whether kernels run on the Triton interpreter (decided when this module is imported,
    which is when Triton reads TRITON_INTERPRET)."""
    return _INTERPRETED


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE for float32 (TF32 would round the inputs)."""
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels widen their tl.dot operands to float32: the Triton interpreter's
    tl.dot misreads bfloat16 (seen with Triton 3.9). Widening bfloat16 is exact, and the
    products accumulate in float32 either way, so the result is the same math."""
    return dtype == torch.bfloat16 and _INTERPRETED


@triton.jit
def _attention_kernel(
    Q,
    K,
    V,
    Out,
    MidO,
    MidLse,
    PageTable,
    SeqLensQ,
    SeqLensK,
    CuSeqlensQ,
    ReqIdx,
    scale,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    stride_pt,
    stride_mid_req,
    stride_mid_head,
    stride_lse_req,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # query tokens per block of rows
    m_block = tl.program_id(0)
    i = tl.program_id(1)  # which of the call's requests
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    b = tl.load(ReqIdx + i).to(tl.int64)
    len_q = tl.load(SeqLensQ + b)
    if m_block * TOKENS < len_q:
        len_k = tl.load(SeqLensK + b)
        q0 = tl.load(CuSeqlensQ + b).to(tl.int64)
        r = tl.arange(0, BLOCK_M)
        tok = m_block * TOKENS + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_mask = (r < TOKENS * GROUP) & (tok < len_q)
        q_pos = len_k - len_q + tok  # >= 0 for every row, padding included: sees key 0
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        io_mask = row_mask[:, None] & d_mask[None, :]
        q_off = (q0 + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
        q = tl.load(Q + q_off, mask=io_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # Keys up to the block's last query; this split's share of them, in whole blocks.
        kv_end = tl.minimum(len_k, len_k - len_q + (m_block + 1) * TOKENS)
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, kv_end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            slots = tl.load(PageTable + b * stride_pt + pos, mask=pos_mask, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + d[None, :]
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
            # Every row sees a key of every block it reaches (an extend's first block holds
            # key 0; a decode sees all its keys), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # p is rounded to the storage dtype, as flash attention does (no-op in float32).
            p = p.to(V.dtype.element_ty).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0  # false only for an empty split
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:
            o_off = (q0 + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head
            tl.store(Out + o_off + d[None, :], o.to(Out.dtype.element_ty), mask=io_mask)
        else:  # one query token: its partial result and log-sum-exp for the merge
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            mid = i * stride_mid_req + head * stride_mid_head + split * HEAD_DIM
            tl.store(MidO + mid[:, None] + d[None, :], o, mask=io_mask)
            tl.store(MidLse + i * stride_lse_req + head * num_splits + split, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    CuSeqlensQ,
    ReqIdx,
    num_splits,
    stride_o_tok,
    stride_o_head,
    stride_mid_req,
    stride_mid_head,
    stride_lse_req,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(ReqIdx + i).to(tl.int64)
    q_row = tl.load(CuSeqlensQ + b).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(
        MidLse + i * stride_lse_req + head * num_splits + s,
        mask=s_mask,
        other=float("-inf"),
    )
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    base = MidO + i * stride_mid_req + head * stride_mid_head
    o = tl.load(
        base + s[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        Out + q_row * stride_o_tok + head * stride_o_head + d,
        out.to(Out.dtype.element_ty),
        mask=d_mask,
    )


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    req_idx: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    num_splits: int = 1,
) -> None:
    """Causal attention of each request b = `req_idx[i]`'s `seq_lens_q[b]` query tokens
    (rows `cu_seqlens_q[b]...` of q) over its `seq_lens_k[b]` keys, written into the same
    rows of `out`. q/out: [T, Hq, D]; pools: [num_slots, Hkv, D]; page_table: [B, >= max
    seq_lens_k] slots. `max_seqlen_q` bounds those requests' query lengths (it sizes the
    grid); a call of decodes only (`max_seqlen_q == 1`) may cut each request's keys into
    `num_splits` ranges."""
    n = int(req_idx.shape[0])
    if n == 0:
        return
    if not 1 <= num_splits <= MAX_SPLITS or (num_splits > 1 and max_seqlen_q > 1):
        raise ValueError(f"{num_splits} splits: 1 to {MAX_SPLITS}, and only for decodes")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    rows = _MIN_DOT if max_seqlen_q == 1 else _EXTEND_ROWS
    block_m = max(rows, triton.next_power_of_2(group))
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if num_splits == 1:  # the kernel writes `out` directly; no partial results
        mid_o = mid_lse = out
        mid_strides = (0, 0, 0)
    else:  # per split: the normalised partial output and its log-sum-exp
        f32 = dict(dtype=torch.float32, device=q.device)
        mid_o = torch.empty(n, num_q_heads, num_splits, head_dim, **f32)
        mid_lse = torch.empty(n, num_q_heads, num_splits, **f32)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0))
    grid = (triton.cdiv(max_seqlen_q, block_m // group), n, num_kv_heads * num_splits)
    _attention_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        mid_o,
        mid_lse,
        page_table,
        seq_lens_q,
        seq_lens_k,
        cu_seqlens_q,
        req_idx,
        scale,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        *mid_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        DIRECT=num_splits == 1,
        PRECISION=_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
    )
    if num_splits > 1:
        _decode_merge_kernel[(n, num_q_heads)](
            mid_o,
            mid_lse,
            out,
            cu_seqlens_q,
            req_idx,
            num_splits,
            out.stride(0),
            out.stride(1),
            *mid_strides,
            HEAD_DIM=head_dim,
            BLOCK_S=MAX_SPLITS,
            BLOCK_D=block_d,
        )
