"""The "torch" backend: paged attention from plain torch ops (any device, any page size).

Per step, requests are split into decodes (one query token) and extends (prefill, chunked
prefill, prefix-cached prefill). Decodes run in the CPU kernel where it can, else as ONE
padded SDPA call: queries gathered into [B, 1, Hq, D], keys/values gathered from the pool
through the page table into [B, max_k, Hkv, D], and a boolean mask for each request's
length. Each extend runs as its own unpadded SDPA call: causal over this step's own K/V
for a fresh prompt, or over its context read from the pool with a bottom-right causal
mask when a prefix or an earlier chunk is already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvray.attention import cpu_decode
from kvray.attention.base import AttentionBackend, AttnMetadata


@dataclass(frozen=True)
class _Group:
    q_index: torch.Tensor  # int64 [B, Lq]: row of q for each (request, query offset)
    padded_rows: torch.Tensor  # int64 [N]: rows of the flattened [B * Lq] output that are real
    tokens: torch.Tensor  # int64 [N]: where those rows go in the flat [T] output
    slots: torch.Tensor  # int64 [B, Lk]: KV slots of key positions 0..Lk-1
    mask: torch.Tensor  # bool [B, 1, Lq, Lk]: True where the query may see the key


def _make_group(meta: AttnMetadata, reqs: torch.Tensor) -> _Group:
    lens_q = meta.seq_lens_q[reqs].long()
    lens_k = meta.seq_lens_k[reqs].long()
    first = meta.cu_seqlens_q[reqs].long()
    max_q, max_k = int(lens_q.max()), int(lens_k.max())
    device = lens_q.device
    off = torch.arange(max_q, device=device)[None, :]
    # Padding queries repeat the request's last token: their rows are computed, never used.
    q_index = first[:, None] + torch.minimum(off, lens_q[:, None] - 1)
    padded_rows = (off < lens_q[:, None]).flatten().nonzero().squeeze(1)
    q_pos = (lens_k - lens_q)[:, None] + off  # [B, Lq]
    k_pos = torch.arange(max_k, device=device)
    # Causal and in-range. A padding query sits past its request's last position, so it
    # still sees key 0: no row is fully masked (which would give NaN).
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < lens_k[:, None, None]
    )
    return _Group(
        q_index=q_index,
        padded_rows=padded_rows,
        tokens=q_index.flatten()[padded_rows],
        slots=meta.page_table[reqs, :max_k],
        mask=mask.unsqueeze(1),
    )


@dataclass(frozen=True)
class _DecodeGroup:
    """Decodes served by the CPU kernel, which reads K/V in place through the page table."""

    tokens: torch.Tensor  # int64 [Bd]: row of each request's one query in q
    slots: torch.Tensor  # int64 [Bd, Lk], contiguous
    seq_lens: torch.Tensor  # int64 [Bd]


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
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        kv = self.kvcache
        self._use_kernel = (
            kv.device.type == "cpu"
            and kv.dtype in (torch.bfloat16, torch.float32)
            and self.head_dim % 16 == 0
            and cpu_decode.available()
        )

    def prepare(self, meta: AttnMetadata) -> None:
        super().prepare(meta)
        decodes, extends = meta.decodes_and_extends()
        self._decode: _DecodeGroup | None = None
        self._groups = []
        if decodes.numel() > 0:
            if self._use_kernel:
                lens = meta.seq_lens_k[decodes].long()
                self._decode = _DecodeGroup(
                    tokens=meta.cu_seqlens_q[decodes].long(),
                    slots=meta.page_table[decodes, : int(lens.max())].contiguous(),
                    seq_lens=lens,
                )
            else:
                self._groups.append(_make_group(meta, decodes))
        self._extends = []
        if extends.numel() > 0:
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
                self._extends.append(_Extend(start, start + lq, slots, mask))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, meta: AttnMetadata) -> Tensor:
        k_pool, v_pool = self.kvcache.k_flat(layer_id), self.kvcache.v_flat(layer_id)
        gqa = self.num_q_heads != self.kvcache.local_kv_heads
        out = q.new_empty(q.shape)
        d = self._decode
        if d is not None:
            out[d.tokens] = cpu_decode.paged_decode(
                q[d.tokens], k_pool, v_pool, d.slots, d.seq_lens, self.scale
            )
        for g in self._groups:
            o = F.scaled_dot_product_attention(
                q[g.q_index].transpose(1, 2),  # [B, Hq, Lq, D]
                k_pool[g.slots].to(q.dtype).transpose(1, 2),  # [B, Hkv, Lk, D]
                v_pool[g.slots].to(q.dtype).transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[g.tokens] = o.transpose(1, 2).flatten(0, 1)[g.padded_rows]
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
        return out.flatten(1)
