"""The "flash_attn" backend: flash-attn's varlen kernel reading the paged pool directly.

Its paged KV (`block_table`) needs pages of a multiple of 256 tokens. The page table holds
raw token slots; the kernel wants page ids, so each request's first slot of every page is
divided by page_size (pages are contiguous runs of slots, first slot a multiple of it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvray.attention.base import AttentionBackend, AttnMetadata
from kvray.kvcache.mha_pool import MHAKVCache

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

PAGE_MULTIPLE = 256


class FlashAttnBackend(AttentionBackend):
    def __init__(
        self, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> None:
        if flash_attn_varlen_func is None:
            raise ImportError("the flash_attn backend needs the flash-attn package")
        if kvcache.page_size % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"the flash_attn backend needs page_size % {PAGE_MULTIPLE} == 0 "
                f"(got page_size={kvcache.page_size}); use page_size 256 or the torch backend"
            )
        super().__init__(kvcache, num_q_heads_local, head_dim, scale)

    def prepare(self, meta: AttnMetadata) -> None:
        super().prepare(meta)
        ps = self.kvcache.page_size
        self._block_table = (meta.page_table[:, ::ps] // ps).to(torch.int32)
        cu_k = torch.zeros_like(meta.cu_seqlens_q)
        torch.cumsum(meta.seq_lens_k, 0, out=cu_k[1:])
        self._cu_seqlens_k = cu_k

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        # causal=True aligns the query block to the END of each key range, which is exactly
        # "query at position p sees keys <= p" when the cache holds positions 0..seq_len_k-1.
        out = flash_attn_varlen_func(
            q,
            self.kvcache.k_cache(layer_id),
            self.kvcache.v_cache(layer_id),
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=self._cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            block_table=self._block_table,
        )
        return out.flatten(1)
