"""Paged decode attention for CPUs: a small C++ kernel built on first use.

Decode attention is memory bound: each step reads every running request's K/V once. The
pure-torch path first gathers those rows into a padded copy and then runs SDPA over it,
moving the data three times. This kernel reads K/V straight from the pool through the page
table, one (request, KV head) pair per task across the cores, with AVX-512 for the dot
products, an exact-to-float32-rounding exp, and the softmax in float32.

`paged_decode(q, k_flat, v_flat, page_table, seq_lens, scale)`:
    q          [B, Hq, D] bfloat16 or float32 (one query token per request)
    k_flat     [slots, Hkv, D] the layer's K pool (same dtype as q); v_flat likewise
    page_table [B, max_len] int64 token slots; seq_lens [B] int64 context lengths
returns [B, Hq, D]. `available()` is False where the kernel cannot be built (no compiler,
no AVX-512): callers then use the torch path.
"""

from __future__ import annotations

import torch

from kvray.cpu_ext import CSRC, CpuExtension

_EXTENSION = CpuExtension(CSRC / "paged_decode.cpp")


def available() -> bool:
    return _EXTENSION.available()


def paged_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    mod = _EXTENSION.load()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available on this machine")
    return mod.paged_decode(q.contiguous(), k_flat, v_flat, page_table, seq_lens, scale)
