"""What every attention backend sees: the per-step `AttnMetadata` and the backend ABC.

A step's batch is flat: request b computes `seq_lens_q[b]` tokens, at positions
`seq_lens_k[b] - seq_lens_q[b] ... seq_lens_k[b] - 1`, stored in `q`/`k`/`v` rows
`cu_seqlens_q[b] : cu_seqlens_q[b + 1]`. Causal rule: a query at position p sees the keys of
its own request at positions <= p, whether they were written this step or earlier (a
cached prefix, an earlier chunk, earlier decode steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvray.core import flat_positions
from kvray.kvcache.mha_pool import MHAKVCache


@dataclass(frozen=True)
class AttnMetadata:
    """Tensors describing one step, built once by the worker and shared by every layer."""

    positions: torch.Tensor  # int64 [T]: position of each token within its request
    out_loc: torch.Tensor  # int64 [T]: KV slot each token's K/V is written to
    seq_lens_q: torch.Tensor  # int32 [B]: tokens computed this step
    seq_lens_k: torch.Tensor  # int32 [B]: context length including this step's tokens
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: prefix sums of seq_lens_q
    # int64 [B, max_seqlen_k]: slot of each position < seq_lens_k; entries past a request's
    # seq_lens_k hold a valid slot (pad_slot) and must be masked out by the backend.
    page_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def decodes_and_extends(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch indices (int64) of the requests computing one token this step (decodes)
        and of those computing several (extends: prefills, chunks, cached-prefix prompts)."""
        is_decode = self.seq_lens_q == 1
        return is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)

    @classmethod
    def build(
        cls,
        page_table: torch.Tensor,
        rows: Sequence[int] | torch.Tensor,
        starts: Sequence[int] | np.ndarray | torch.Tensor,
        extend_lens: Sequence[int] | np.ndarray | torch.Tensor,
        pad_slot: int = 0,
        positions: torch.Tensor | None = None,
    ) -> AttnMetadata:
        """Metadata for requests whose slots live in rows `rows` of `page_table` (one row per
        request, raw token slots per position, e.g. the worker's page-table mirror). Request
        b computes positions `starts[b] : starts[b] + extend_lens[b]`; their slots must
        already be in the table, and `out_loc` is read from it (one home for the fact).
        `positions` (those positions, flat, on the table's device) may be passed where the
        caller has them already (`StepPlan.spans`)."""
        device = page_table.device
        # Copies (plans may arrive as read-only buffers), on the host.
        starts_t = torch.from_numpy(np.array(starts, dtype=np.int64))
        lens_q = torch.from_numpy(np.array(extend_lens, dtype=np.int64))
        if starts_t.shape != lens_q.shape or bool((lens_q <= 0).any()):
            raise ValueError("every request must compute at least one token")
        lens_k = starts_t + lens_q
        max_q, max_k = int(lens_q.max()), int(lens_k.max())
        rows_t = torch.as_tensor(rows, dtype=torch.int64, device=device)
        table = page_table[rows_t, :max_k].to(torch.int64)
        lens_k_dev = lens_k.to(device)
        past_end = torch.arange(max_k, device=device)[None, :] >= lens_k_dev[:, None]
        table = table.masked_fill(past_end, pad_slot)

        batch_idx = torch.repeat_interleave(torch.arange(len(lens_q)), lens_q).to(device)
        cu_q = torch.zeros(len(lens_q) + 1, dtype=torch.int64)
        torch.cumsum(lens_q, 0, out=cu_q[1:])
        if positions is None:
            positions = torch.from_numpy(flat_positions(starts_t.numpy(), lens_q.numpy()))
        positions = positions.to(device)
        return cls(
            positions=positions,
            out_loc=table[batch_idx, positions],
            seq_lens_q=lens_q.to(device, torch.int32),
            seq_lens_k=lens_k_dev.to(torch.int32),
            cu_seqlens_q=cu_q.to(device, torch.int32),
            page_table=table,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
        )


class AttentionBackend(ABC):
    """Attention over an `MHAKVCache`. `prepare(meta)` runs once per step; then every
    layer calls `forward`, which first stores this step's K/V at `meta.out_loc` and then
    attends (`attend`, what a backend implements) over each request's whole context read
    back from the cache."""

    def __init__(
        self, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> None:
        if num_q_heads_local % kvcache.local_kv_heads != 0:
            raise ValueError(
                f"{num_q_heads_local} local q heads are not a multiple of "
                f"{kvcache.local_kv_heads} local kv heads"
            )
        self.kvcache = kvcache
        self.num_q_heads = num_q_heads_local
        self.head_dim = head_dim
        self.scale = scale
        self.meta: AttnMetadata | None = None

    def prepare(self, meta: AttnMetadata) -> None:
        self.meta = meta

    def _prepared(self) -> AttnMetadata:
        if self.meta is None:
            raise RuntimeError("attention backend used before prepare(meta)")
        return self.meta

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. Stores this step's K/V at
        `meta.out_loc` first, so `attend` reads them back with the cached ones."""
        meta = self._prepared()
        self.kvcache.store_kv(k, v, meta.out_loc, layer_id)
        return self.attend(q, k, v, layer_id, meta)

    @abstractmethod
    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        """Attention of this step's queries over each request's context in layer
        `layer_id` of the pool (this step's k/v are already stored there)."""
