"""The "triton" backend: paged attention kernels in Triton (`kvray.attention.triton_ops`).

The default on CUDA when flash-attn is not installed (or the page size does not suit it).
Each step launches the paged kernel once for its decodes (one query token each; the keys
of each may be split over several programs when the batch is too small to fill the GPU)
and once for its extends (prefill, a chunk of one, or a prompt after a cached prefix). It
reads K/V in place through the page table, for any page size, after this step's K/V have
been stored, so cached and new keys are one sequence to it.

It runs on CUDA devices, and on CPUs under the Triton interpreter (`TRITON_INTERPRET=1`),
which is how CI checks it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvray.attention import triton_ops
from kvray.attention.base import AttentionBackend, AttnMetadata
from kvray.kvcache.mha_pool import MHAKVCache

# Split-K decode: aim for at least this many programs per streaming multiprocessor, and
# never cut a request's keys into more pieces than this.
_PROGRAMS_PER_SM = 2
# The interpreter runs one program at a time: as one multiprocessor, it rarely splits.
_INTERPRETED_SMS = 1


def decode_splits(num_decodes: int, num_kv_heads: int, num_sms: int) -> int:
    """Key ranges per (request, KV head) for a decode batch: enough programs to fill the
    device's `num_sms` multiprocessors, fewer as the batch grows. A function of the batch
    size only (not of context lengths), so a captured decode graph keeps its launch shape."""
    programs = max(1, num_decodes * num_kv_heads)
    target = _PROGRAMS_PER_SM * num_sms
    return max(1, min(triton_ops.MAX_SPLITS, -(-target // programs)))


class TritonAttentionBackend(AttentionBackend):
    def __init__(
        self,
        kvcache: MHAKVCache,
        num_q_heads_local: int,
        head_dim: int,
        scale: float,
        num_splits: int | None = None,
    ) -> None:
        """`num_splits` fixes the decode split count (None: chosen per step from the
        batch size and the device's multiprocessors)."""
        device = kvcache.device
        if device.type != "cuda" and not triton_ops.interpreted():
            raise ValueError(
                f"the triton attention backend runs on CUDA devices (the KV pool is on "
                f"{device.type}); on CPUs it runs only under TRITON_INTERPRET=1, for tests"
            )
        super().__init__(kvcache, num_q_heads_local, head_dim, scale)
        self._num_splits = num_splits
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else _INTERPRETED_SMS
        )

    def prepare(self, meta: AttnMetadata) -> None:
        super().prepare(meta)
        decodes, extends = meta.decodes_and_extends()
        max_extend_q = int(meta.seq_lens_q[extends].max()) if extends.numel() else 0
        splits = self._num_splits or decode_splits(
            int(decodes.numel()), self.kvcache.local_kv_heads, self._num_sms
        )
        # One kernel launch per kind: (requests, longest query, decode splits).
        self._launches = [
            (idx.to(torch.int32), max_q, n_splits)
            for idx, max_q, n_splits in ((decodes, 1, splits), (extends, max_extend_q, 1))
            if idx.numel()
        ]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        k_pool, v_pool = self.kvcache.k_flat(layer_id), self.kvcache.v_flat(layer_id)
        if q.stride(-1) != 1:  # the kernel indexes head_dim with unit stride
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for req_idx, max_q, num_splits in self._launches:
            triton_ops.paged_attention(
                q,
                k_pool,
                v_pool,
                out,
                meta.page_table,
                meta.seq_lens_q,
                meta.seq_lens_k,
                meta.cu_seqlens_q,
                req_idx,
                max_q,
                self.scale,
                num_splits,
            )
        return out.flatten(1)
