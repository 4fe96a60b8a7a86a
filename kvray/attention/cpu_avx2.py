"""Paged attention for CPUs with AVX2 and FMA, where kvray's AVX-512 kernels
(`kvray.attention.cpu_paged`) do not build: a small C++ extension built on first use
(`kvray/csrc/paged_attention_avx2.cpp`) that reads K/V straight from the pool through each
request's slots.

`paged_attend(q, k_flat, v_flat, requests, scale, out) -> bool`: every request of a step in
one call, a decode (one query) and an extend (a prompt, a chunk of one, a suffix after a
cached prefix, the positions a speculative step checks) alike: each request's queries over
its whole context, causally. Flash-style: blocks of 32 keys, an online softmax in float32,
products summed in float32; a bfloat16 pool is widened on load and the output rounded to
nearest even. Each task is one request's block of 16 query positions for one KV head (all
of them when there are tasks enough for the threads), with every query head of each head's
group, so K/V are read once per block for the whole group.
    q          [T, Hq, D] float32 or bfloat16 (head_dim contiguous; its rows may be a view of
               a wider projection)
    k_flat     [slots, Hkv, D] the layer's K pool (q's dtype, contiguous); v_flat likewise
    requests   `cpu_paged.Extends`: request e's queries are rows q_start[e] ..
               q_start[e] + q_len[e] - 1 of q, its context's slots slots[k_start[e] :
               k_start[e + 1]] (its queries' own keys last)
    out        [T, Hq, D] like q: each request's rows are written
It returns False (and computes nothing) for another dtype, a head_dim that is not a
multiple of 8 up to 256, or more than 16 query heads per KV head.

Why: the torch path gathers every request's context out of the pool (`aten::index`) and
runs one SDPA call per request that checks drafts; on an AVX2 CPU those two took 60% of
`kvray bench offline`'s step time, more than the linears.

`available()` is False where the extension cannot be built (no compiler, no AVX2/FMA, or
KVRAY_CPU_KERNELS=0): callers then use the torch path.
"""

from __future__ import annotations

import torch

from kvray.attention.cpu_paged import Extends
from kvray.cpu_ext import CSRC, CpuExtension

_EXTENSION = CpuExtension(CSRC / "paged_attention_avx2.cpp", requires=("avx2", "fma"))
# What the kernel serves (it declines anything else).
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_GROUP = 16


def available() -> bool:
    return _EXTENSION.available()


def serves(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `paged_attend` runs (rather than declines) for such a pool and heads."""
    return (
        dtype in DTYPES
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
    )


def paged_attend(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    requests: Extends,
    scale: float,
    out: torch.Tensor,
) -> bool:
    ran: bool = _EXTENSION.require().paged_attend(
        q, k_flat, v_flat, *requests.tensors(), scale, out
    )
    return ran
