"""Tensor-parallel building blocks of the Llama family.

Sharding convention: a rank owns a contiguous range of the sharded dimension, given by
`shard()`. Column-parallel layers own output rows (no communication); row-parallel layers
own input columns and all-reduce their partial sums; the vocab-parallel embedding owns a
range of (padded) vocab rows. Every layer with weights has `load_weight(param, src, part)`,
which copies this rank's slice of a checkpoint tensor; `src` is anything sliceable like a
tensor (a safetensors slice reads only the requested rows/columns from disk).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvray.core import div_ceil
from kvray.kvcache.base import div_even
from kvray.models import fused, packed
from kvray.models.config import RopeScaling
from kvray.models.tp import TPGroup


def shard(n: int, tp: TPGroup, replicate: bool = False) -> slice:
    """This rank's range of `n` items split evenly over the group. With `replicate`,
    `tp.size > n` is allowed: item `rank // (tp.size // n)` then goes to this rank."""
    local = div_even(n, tp.size, allow_replicate=replicate)
    ranks_per_item = max(1, tp.size // n)
    start = (tp.rank // ranks_per_item) * local
    return slice(start, start + local)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _len(s: slice) -> int:
    return s.stop - s.start


class PackableLinear(nn.Module):
    """A module whose `weight` [out, in] may be packed once loaded (`pack_weights`): the
    oneDNN copy then serves every product and the dense weight's memory is released (it
    stays as a shape-only meta tensor, so parameter counts still hold)."""

    weight: nn.Parameter
    _packed: torch.Tensor | None = None
    _tiles: torch.Tensor | None = None  # the AMX tile-layout copy, for a few rows

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._packed is not None:
            return packed.packed_linear(x, self._packed, bias, self._tiles, self.weight.shape[0])
        return F.linear(x, self.weight, bias)

    def pack_weights(self, keep_dense: bool = False, tiles: bool = False) -> bool:
        """Pack the weight for this CPU if that helps (`packed.can_pack`); returns whether it
        did. `keep_dense` keeps the dense weight too (a tied embedding still needs it);
        `tiles` adds the AMX tile-layout copy for products of a few rows, where it can."""
        if self._packed is not None or not packed.can_pack(self.weight):
            return self._packed is not None
        if tiles and packed.can_tile(self.weight):
            self._tiles = packed.pack_tiles(self.weight)
        self._packed = packed.pack(self.weight)
        if not keep_dense:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)
        return True

    def _check_loadable(self) -> None:
        if self._packed is not None:
            raise RuntimeError("weights are packed: load them before pack_weights()")


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) for this rank's output rows. Several checkpoint tensors can be merged
    into one matmul (QKV, gate/up): `row_slices[i]` are the rows this rank takes from the
    i-th checkpoint tensor ("part"), stacked in part order."""

    def __init__(self, in_features: int, row_slices: Sequence[slice], bias: bool) -> None:
        super().__init__()
        self.row_slices = tuple(row_slices)
        self.out_sizes = [_len(s) for s in self.row_slices]
        self.offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]
        self.num_parts = len(self.row_slices)
        self.weight = _param(sum(self.out_sizes), in_features)
        self.bias = _param(sum(self.out_sizes)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`fused.silu_mul(self(x))` for a [gate | up] layer (two parts of one size): the
        same bits, in one pass on the tile kernel where it serves x."""
        halves = self.num_parts == 2 and self.out_sizes[0] == self.out_sizes[1]
        if self._tiles is not None and self.bias is None and halves:
            out = packed.silu_mul_tiles(x, self._tiles, self.out_sizes[0])
            if out is not None:
                return out
        return fused.silu_mul(self(x))

    def load_weight(self, param: str, src: Any, part: int = 0) -> None:
        self._check_loadable()
        rows, off = self.row_slices[part], self.offsets[part]
        getattr(self, param).data[off : off + _len(rows)].copy_(src[rows.start : rows.stop])


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_local W_local^T) (+ b): this rank owns input columns `col_slice`.
    The bias is replicated and added once, after the reduction."""

    def __init__(self, col_slice: slice, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.col_slice = col_slice
        self.tp = tp
        self.weight = _param(out_features, _len(col_slice))
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._linear(x))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: str, src: Any, part: int = 0) -> None:
        self._check_loadable()
        if param == "weight":
            self.weight.data.copy_(src[:, self.col_slice.start : self.col_slice.stop])
        else:
            getattr(self, param).data.copy_(src[:])


class VocabParallelEmbedding(PackableLinear):
    """Token embedding sharded over vocab rows; also the vocab-parallel LM head (`logits`).

    The vocab is padded up to `tp.size * rows_per_rank`; padding rows are zero and their
    logits are trimmed, so callers only ever see `vocab_size` columns.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.rows_per_rank = div_ceil(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        # Real (non-padding) rows of this shard; may be fewer than rows_per_rank, even 0.
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))
        self.weight = _param(self.rows_per_rank, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)  # other ranks own these ids
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab_size] logits, gathered from every rank."""
        local = self._linear(hidden)
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]

    def load_weight(self, param: str, src: Any, part: int = 0) -> None:
        self._check_loadable()
        n = self.num_real_rows
        self.weight.data[:n].copy_(src[self.vocab_start : self.vocab_start + n])
        self.weight.data[n:].zero_()


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 (as transformers does).

    Both methods give transformers' result bit for bit; on CPUs they run fused kernels
    (`kvray.models.fused`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual), the sum rounded to x's dtype as `x + residual`
        rounds it; both new tensors."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)

    def load_weight(self, param: str, src: Any, part: int = 0) -> None:
        self.weight.data.copy_(src[:])


class RotaryEmbedding:
    """Rotary position embedding (rotate-half layout), frequencies as in transformers."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device | str,
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, head_dim], for the given positions."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token angles (cos/sin [T, D]), rotate-half layout.

    On CPUs this rotates x IN PLACE and returns it (elsewhere it returns a new tensor): x
    must be the caller's own (e.g. a view of a fresh projection), and the caller must use
    the returned tensor."""
    return fused.rotary(x, cos, sin)
