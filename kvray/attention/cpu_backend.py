"""The "cpu" backend: the torch backend with decodes in kvray's C++ kernel
(`kvray.attention.cpu_decode`), which reads K/V in place through the page table instead of
gathering a padded copy. The `auto` choice on CPUs where the kernel builds (AVX-512), for
bfloat16 and float32 pools and head sizes that are a multiple of 16."""

from __future__ import annotations

import torch
from torch import Tensor

from kvray.attention import cpu_decode
from kvray.attention.base import AttnMetadata
from kvray.attention.torch_backend import Decodes, TorchAttentionBackend
from kvray.kvcache.mha_pool import MHAKVCache


def supports(kvcache: MHAKVCache, head_dim: int) -> bool:
    """Whether the kernel serves this pool and head size on this machine."""
    return (
        kvcache.device.type == "cpu"
        and kvcache.dtype in (torch.bfloat16, torch.float32)
        and head_dim % 16 == 0
        and cpu_decode.available()
    )


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(
        self, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> None:
        if not supports(kvcache, head_dim):
            raise ValueError(
                "the cpu attention backend needs a bfloat16 or float32 KV pool on the CPU, a "
                "head_dim that is a multiple of 16, and an AVX-512 CPU with a C++ compiler "
                f"(got {kvcache.dtype} on {kvcache.device}, head_dim {head_dim}); use torch"
            )
        super().__init__(kvcache, num_q_heads_local, head_dim, scale)

    def prepare_decodes(self, meta: AttnMetadata, decodes: Tensor) -> Decodes:
        lens = meta.seq_lens_k[decodes].long()
        return Decodes(
            tokens=meta.cu_seqlens_q[decodes].long(),
            slots=meta.page_table[decodes, : int(lens.max())].contiguous(),
            seq_lens=lens,
        )

    def attend_decodes(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, d: Decodes) -> Tensor:
        return cpu_decode.paged_decode(
            d.queries(q), k_pool, v_pool, d.slots, d.seq_lens, self.scale
        )
