"""The "torch" backend: paged attention from plain torch ops (any device, any page size).

Per step, requests are split into decodes (one query token) and extends (prefill, chunked
prefill, prefix-cached prefill). Decodes run as ONE padded SDPA call: queries [B, Hq, 1, D],
keys/values gathered from the pool through the page table into [B, Hkv, max_k, D], and a
mask of each request's length (the "cpu" backend, a subclass, runs them in a C++ kernel
instead). Each extend runs as its own unpadded SDPA call: causal over this step's own K/V
for a fresh prompt, or over its context read from the pool with a bottom-right causal
mask when a prefix or an earlier chunk is already cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from kvray.attention.base import AttentionBackend, AttnMetadata


@dataclass(frozen=True)
class Decodes:
    """The step's decodes, attended together."""

    tokens: Tensor  # int64 [Bd]: the row of each request's one query in q
    slots: Tensor  # int64 [Bd, max_k]: KV slots of each request's keys (padded past its length)
    seq_lens: Tensor  # int64 [Bd]: keys per request
    mask: Tensor | None = None  # bool [Bd, 1, 1, max_k]: key < seq_len (the SDPA path's)
    # Every row of q is a decode, in order (tokens == arange): q is their queries as it is,
    # and their output is the step's whole output (no gather, no scatter).
    whole_batch: bool = False

    def queries(self, q: Tensor) -> Tensor:
        """[Bd, Hq, D]: each decode's query row."""
        return q if self.whole_batch else q[self.tokens]


@dataclass(frozen=True)
class _Extend:
    """One request computing several tokens (prefill, a chunk of one, or a prompt after a
    cached prefix): attended on its own, unpadded. Padding a batch of prompts out to the
    longest, and masking instead of skipping the causal half, cost several times the
    attention FLOPs (over half of a 2048-token CPU prefill step)."""

    start: int  # its rows in q: start .. end - 1
    end: int
    # int64 [Lk]: KV slots of its whole context, or None when the context is just this
    # step's tokens (then k/v are used as given and the mask is plain causal).
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # bool [Lq, Lk]: query i sees keys <= Lk - Lq + i


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, meta: AttnMetadata) -> None:
        super().prepare(meta)
        decodes, extends = meta.decodes_and_extends()
        self._decodes = None
        if decodes.numel():
            d = self.prepare_decodes(meta, decodes)
            self._decodes = replace(d, whole_batch=extends.numel() == 0)
        self._extends = self.prepare_extends(meta, extends)

    def prepare_extends(self, meta: AttnMetadata, extends: Tensor) -> list[_Extend]:
        """What `attend_extends` reads for the extends at batch indices `extends`: each
        one's rows, and its context's slots and causal mask where a prefix is cached."""
        out: list[_Extend] = []
        if extends.numel() == 0:
            return out
        starts = meta.cu_seqlens_q[extends].tolist()
        lens_q = meta.seq_lens_q[extends].tolist()
        lens_k = meta.seq_lens_k[extends].tolist()
        device = meta.page_table.device
        for b, start, lq, lk in zip(extends.tolist(), starts, lens_q, lens_k, strict=True):
            slots = mask = None
            if lk != lq:
                slots = meta.page_table[b, :lk]
                k_pos = torch.arange(lk, device=device)
                q_pos = torch.arange(lk - lq, lk, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]
            out.append(_Extend(start, start + lq, slots, mask))
        return out

    def prepare_decodes(self, meta: AttnMetadata, decodes: Tensor) -> Decodes:
        lens = meta.seq_lens_k[decodes].long()
        max_k = int(lens.max())
        in_range = torch.arange(max_k, device=lens.device)[None, :] < lens[:, None]
        return Decodes(
            tokens=meta.cu_seqlens_q[decodes].long(),
            slots=meta.page_table[decodes, :max_k],
            seq_lens=lens,
            mask=in_range[:, None, None, :],
        )

    def attend_decodes(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, d: Decodes) -> Tensor:
        """[Bd, Hq, D]: each decode's query over its keys."""
        o = F.scaled_dot_product_attention(
            d.queries(q).unsqueeze(2),  # [Bd, Hq, 1, D]
            k_pool[d.slots].to(q.dtype).transpose(1, 2),  # [Bd, Hkv, max_k, D]
            v_pool[d.slots].to(q.dtype).transpose(1, 2),
            attn_mask=d.mask,
            scale=self.scale,
            enable_gqa=self.num_q_heads != self.kvcache.local_kv_heads,
        )
        return o.squeeze(2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        k_pool, v_pool = self.kvcache.k_flat(layer_id), self.kvcache.v_flat(layer_id)
        if self._decodes is not None and self._decodes.whole_batch:
            return self.attend_decodes(q, k_pool, v_pool, self._decodes).flatten(1)
        out = q.new_empty(q.shape)
        if self._decodes is not None:
            out[self._decodes.tokens] = self.attend_decodes(q, k_pool, v_pool, self._decodes)
        self.attend_extends(q, k, v, k_pool, v_pool, out)
        return out.flatten(1)

    def attend_extends(
        self, q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor
    ) -> None:
        """Writes each extend's rows of `out` [T, Hq, D]: its queries over its context."""
        gqa = self.num_q_heads != self.kvcache.local_kv_heads
        for e in self._extends:
            if e.slots is None:
                k_e, v_e = k[e.start : e.end], v[e.start : e.end]
            else:
                k_e, v_e = k_pool[e.slots].to(q.dtype), v_pool[e.slots].to(q.dtype)
            o = F.scaled_dot_product_attention(
                q[e.start : e.end].transpose(0, 1).unsqueeze(0),  # [1, Hq, Lq, D]
                k_e.transpose(0, 1).unsqueeze(0),  # [1, Hkv, Lk, D]
                v_e.transpose(0, 1).unsqueeze(0),
                attn_mask=e.mask,
                is_causal=e.mask is None,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[e.start : e.end] = o.squeeze(0).transpose(0, 1)
