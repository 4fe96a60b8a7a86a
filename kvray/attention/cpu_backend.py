"""The "cpu" backend: the torch backend with kvray's C++ kernels, which read K/V in place
through the page table. Which kernels depends on the CPU (`create`):
- AVX-512 (`CpuAttentionBackend`, `kvray.attention.cpu_paged`): decodes always, and prompts
  (chunks, suffixes of cached prefixes) on the AMX tile unit or AVX-512 BF16 where the CPU
  has them (bfloat16 pools, head_dim 32, 64, 128 or 256), else torch's SDPA as in the torch
  backend; head sizes that are a multiple of 16.
- AVX2 without AVX-512 (`Avx2AttentionBackend`, `kvray.attention.cpu_avx2`): every request
  of a step, decode or extend, in one kernel call per layer; head sizes that are a
  multiple of 8, up to 256.
The `auto` choice on CPUs where one of them builds, for bfloat16 and float32 pools."""

from __future__ import annotations

import torch
from torch import Tensor

from kvray.attention import cpu_avx2, cpu_paged
from kvray.attention.base import AttentionBackend, AttnMetadata
from kvray.attention.torch_backend import Decodes, TorchAttentionBackend, _Extend
from kvray.kvcache.mha_pool import MHAKVCache


def supports(kvcache: MHAKVCache, head_dim: int) -> bool:
    """Whether the kernels serve this pool and head size on this machine."""
    if kvcache.device.type != "cpu" or kvcache.dtype not in (torch.bfloat16, torch.float32):
        return False
    if cpu_paged.available():
        return head_dim % 16 == 0
    return head_dim % 8 == 0 and head_dim <= cpu_avx2.MAX_HEAD_DIM and cpu_avx2.available()


def _requests(meta: AttnMetadata, batch: Tensor | slice = slice(None)) -> cpu_paged.Extends:
    """The kernels' view of the requests at batch indices `batch` (all by default): their
    query rows, and each one's context slots, concatenated (read by every layer of the
    step)."""
    lens_k = meta.seq_lens_k[batch].long()
    in_context = torch.arange(meta.page_table.shape[1]) < lens_k[:, None]
    return cpu_paged.Extends(
        slots=meta.page_table[batch][in_context].contiguous(),
        k_start=torch.cat([lens_k.new_zeros(1), lens_k.cumsum(0)]),
        q_start=meta.cu_seqlens_q[:-1][batch].long(),
        q_len=meta.seq_lens_q[batch].long(),
    )


def create(
    kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
) -> AttentionBackend:
    """The "cpu" backend for this machine: the AVX-512 kernels where they build, else the
    AVX2 kernel."""
    if cpu_paged.available() or not supports(kvcache, head_dim):
        return CpuAttentionBackend(kvcache, num_q_heads_local, head_dim, scale)  # or its error
    return Avx2AttentionBackend(kvcache, num_q_heads_local, head_dim, scale)


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(
        self, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> None:
        if not supports(kvcache, head_dim):
            raise ValueError(
                "the cpu attention backend needs a bfloat16 or float32 KV pool on the CPU, a "
                "head_dim that is a multiple of 16 (of 8, up to 256, on an AVX2 CPU without "
                "AVX-512), and a C++ compiler "
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
        self._paged_extends = _requests(meta, extends)
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


class Avx2AttentionBackend(TorchAttentionBackend):
    """Every request of a step through `cpu_avx2.paged_attend`, one call per layer: no
    gathered copy of any context, no call per request. The torch path serves instead where
    the kernel does not (more than `cpu_avx2.MAX_GROUP` query heads per KV head)."""

    def __init__(
        self, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> None:
        super().__init__(kvcache, num_q_heads_local, head_dim, scale)
        self._kernel = cpu_avx2.available() and cpu_avx2.serves(
            kvcache.dtype, num_q_heads_local, kvcache.local_kv_heads, head_dim
        )
        self._requests: cpu_paged.Extends | None = None

    def prepare(self, meta: AttnMetadata) -> None:
        if not self._kernel:
            super().prepare(meta)
            return
        self.meta = meta
        self._requests = _requests(meta)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        if not self._kernel or self._requests is None:
            return super().attend(q, k, v, layer_id, meta)
        k_pool, v_pool = self.kvcache.k_flat(layer_id), self.kvcache.v_flat(layer_id)
        out = q.new_empty(q.shape)
        if not cpu_avx2.paged_attend(q, k_pool, v_pool, self._requests, self.scale, out):
            raise RuntimeError("the AVX2 attention kernel declined a pool it was chosen for")
        return out.flatten(1)
