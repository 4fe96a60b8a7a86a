"""The "cpu" backend: the torch backend with kvray's C++ kernels (`kvray.attention.cpu_paged`),
which read K/V in place through the page table: decodes always, and prompts (chunks,
suffixes of cached prefixes) on the AMX tile unit or AVX-512 BF16 where the CPU has them
(bfloat16 pools, head_dim 32, 64, 128 or 256), else torch's SDPA as in the torch backend.
The `auto` choice on CPUs where the kernels build (AVX-512), for bfloat16 and float32 pools
and head sizes that are a multiple of 16."""

from __future__ import annotations

import torch
from torch import Tensor

from kvray.attention import cpu_paged
from kvray.attention.base import AttnMetadata
from kvray.attention.torch_backend import Decodes, TorchAttentionBackend, _Extend
from kvray.kvcache.mha_pool import MHAKVCache


def supports(kvcache: MHAKVCache, head_dim: int) -> bool:
    """Whether the kernels serve this pool and head size on this machine."""
    return (
        kvcache.device.type == "cpu"
        and kvcache.dtype in (torch.bfloat16, torch.float32)
        and head_dim % 16 == 0
        and cpu_paged.available()
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
        # Whether the prompt kernel may run here: cleared for good the first time it
        # declines (a CPU without AVX-512 BF16).
        self._extend_kernel = kvcache.dtype == torch.bfloat16 and head_dim in (32, 64, 128, 256)
        self._paged_extends: cpu_paged.Extends | None = None

    def prepare_extends(self, meta: AttnMetadata, extends: Tensor) -> list[_Extend]:
        """The prompt kernel's input (`_paged_extends`) where it may run; then SDPA's
        per-extend data (causal masks included) is built only if the kernel declines."""
        self._paged_extends = None
        if extends.numel() == 0 or not self._extend_kernel:
            return super().prepare_extends(meta, extends)
        lens_k = meta.seq_lens_k[extends].long()
        # Each extend's context slots, concatenated (read by every layer of the step).
        in_context = torch.arange(meta.page_table.shape[1]) < lens_k[:, None]
        self._paged_extends = cpu_paged.Extends(
            slots=meta.page_table[extends][in_context].contiguous(),
            k_start=torch.cat([lens_k.new_zeros(1), lens_k.cumsum(0)]),
            q_start=meta.cu_seqlens_q[extends].long(),
            q_len=meta.seq_lens_q[extends].long(),
        )
        return []

    def prepare_decodes(self, meta: AttnMetadata, decodes: Tensor) -> Decodes:
        lens = meta.seq_lens_k[decodes].long()
        return Decodes(
            tokens=meta.cu_seqlens_q[decodes].long(),
            slots=meta.page_table[decodes, : int(lens.max())].contiguous(),
            seq_lens=lens,
        )

    def attend_decodes(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, d: Decodes) -> Tensor:
        return cpu_paged.paged_decode(d.queries(q), k_pool, v_pool, d.slots, d.seq_lens, self.scale)

    def attend_extends(
        self, q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor
    ) -> None:
        if self._paged_extends is not None:
            if cpu_paged.paged_extend(q, k_pool, v_pool, self._paged_extends, self.scale, out):
                return
            # Declined (for good): this step's extends go to SDPA from here on.
            self._extend_kernel = False
            self._paged_extends = None
            meta = self._prepared()
            self._extends = super().prepare_extends(meta, meta.decodes_and_extends()[1])
        super().attend_extends(q, k, v, k_pool, v_pool, out)
