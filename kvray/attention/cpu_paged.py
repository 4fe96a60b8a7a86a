"""Paged attention kernels for CPUs: a small C++ extension built on first use
(`kvray/csrc/paged_attention.cpp`), reading K/V straight from the pool through the page
table.

`paged_decode(q, k_flat, v_flat, page_table, seq_lens, scale)`: one query per request.
Decode attention is memory bound: each step reads every running request's K/V once. The
pure-torch path first gathers those rows into a padded copy and then runs SDPA over it,
moving the data three times. This kernel reads K/V in place, one request per task across
the cores, an exact-to-float32-rounding exp, and the softmax in float32. In bfloat16 on a
CPU with AMX (and `tiles`) the products run on the tile unit, 16 keys of the pool at a time
read in place as tiles; elsewhere on AVX-512 (BF16 dot products where the CPU has them).
Both round the probabilities to bf16 for P.V.
    q          [B, Hq, D] bfloat16 or float32 (one query token per request); each
               request's Hq x D contiguous, its rows may be a view of a wider projection
    k_flat     [slots, Hkv, D] the layer's K pool (same dtype as q); v_flat likewise
    page_table [B, max_len] int64 token slots; seq_lens [B] int64 context lengths
returns [B, Hq, D].

`paged_extend(q, k_flat, v_flat, extends, scale, out, tiles=True) -> bool`: each extending
request's queries (a prompt, a chunk of one, or the part after a cached prefix) over its
whole context, causally (flash-style: online softmax in float32, bf16 products summed in
float32), on the AMX tile unit where the CPU and OS give it (and `tiles`), else on AVX-512
BF16 dot products (AMD Zen 4/5, Intel Cooper Lake and later).
That engine takes P.V over each probability's bf16 rounding and over what the rounding
left, so its P is as exact as float32's: with bf16 P alone it tipped a near tie that
float32 attention does not (the README's chat request: "The" at logprob -1.88 in float32,
"L'" at -1.90 with it).
Compute bound where decode is memory bound: torch's CPU flash SDPA reaches a fraction of
the matmul peak on prompt lengths of a few hundred tokens, and ran a third of a
4,096-token bf16 prefill step on either kind of CPU. bfloat16 pools and head_dim 32, 64,
128 or 256 only; it returns False (and computes nothing) where it cannot run: no AVX-512
BF16, another dtype or head size.
Writes each extend's rows of `out` [T, Hq, D].

`available()` is False where the extension cannot be built (no compiler, no AVX-512):
callers then use the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.cpu_ext import CSRC, CpuExtension

_EXTENSION = CpuExtension(CSRC / "paged_attention.cpp")


def available() -> bool:
    return _EXTENSION.available()


def paged_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: bool = True,
) -> torch.Tensor:
    return _EXTENSION.require().paged_decode(q, k_flat, v_flat, page_table, seq_lens, scale, tiles)


@dataclass(frozen=True)
class Extends:
    """A step's extending requests, as `paged_extend` reads them: request e's queries are
    rows `q_start[e] .. q_start[e] + q_len[e] - 1` of the step's q, and its context's
    slots are `slots[k_start[e] : k_start[e + 1]]` (its queries' own keys last)."""

    slots: torch.Tensor  # int64 [sum of context lengths]
    k_start: torch.Tensor  # int64 [E + 1]
    q_start: torch.Tensor  # int64 [E]
    q_len: torch.Tensor  # int64 [E]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernels' arguments after q, k and v: slots, k_start, q_start, q_len."""
        return self.slots, self.k_start, self.q_start, self.q_len


def paged_extend(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    extends: Extends,
    scale: float,
    out: torch.Tensor,
    tiles: bool = True,
) -> bool:
    ran: bool = _EXTENSION.require().paged_extend(
        q, k_flat, v_flat, *extends.tensors(), scale, out, tiles
    )
    return ran
