"""Linear weights prepacked for oneDNN on CPUs: bfloat16 where oneDNN has fast bfloat16
kernels (AVX-512), float32 where it does not.

`F.linear` on a CPU hands oneDNN a plain row-major weight, which it reorders into its
blocked layout on every call. Packing once at load time skips that: about 8% of a 128-token
bf16 decode step here. The packed product is bit-identical to `F.linear` in bfloat16 for any
number of rows (checked in tests/test_packed_linear.py).

float32 `F.linear` runs on MKL, not oneDNN, so a packed float32 product is oneDNN's summation
order, not `F.linear`'s: they differ in the last bits (as MKL's own products of 1-7 rows
differ from its products of more), and token parity with Hugging Face is what the tests
hold it to. Where AVX-512 gives bfloat16 (the dtype those machines serve in), float32 is
left on `F.linear`. Where it does not (AVX2 only), float32 is the dtype `auto` serves in,
and oneDNN's packed products were much faster there: on a 2-core AMD EPYC with AVX2, at 8 /
32 / 128 rows, 2.3x / 1.6x / 1.5x MKL's for the embedded model's gate_up weight and 2.9x /
2.3x / 1.5x for its LM head (49152 x 576), level at 256 rows. Each row's packed product
there was also the same whatever the batch (MKL's changes below 8 rows).

A packed weight is an opaque oneDNN tensor: it only feeds `packed_linear`.

Decode-sized batches are oneDNN's weak spot: its packed product streams the weights at a
fraction of the memory bandwidth at a few rows, and is well short of the tile unit's peak
at a few dozen. Where the CPU has AMX, a weight may also get a copy in the tile unit's
layout (`pack_tiles`, kvray/csrc/amx_linear.cpp), and `packed_linear` then multiplies up
to `tile_rows(tiles)` rows on it. How many depends on the weight's size (TILE_ROWS_BY_SIZE),
measured here against oneDNN with the weights coming from memory: the tile kernel reads each
weight once per call but passes every 32-row block of x over each 32-column block of it,
so its lead shrinks with the rows and the output's size.
- The embedded model's layers (at most 3.4 MiB each): 10-35% shorter at 64-512 rows.
- Qwen3-0.6B-sized layers (up to 12 MiB): 10-15% shorter at 64-160 rows, level or behind
  from 192.
- Llama-1B-sized layers and 49k-151k vocabulary heads (57-300 MiB): level at 64-96 rows,
  4-70% longer from 128 (the embedded model's LM head at 160 rows: 8.6 against 5.9 ms).
So a 256-token prompt's layers run on the tiles, a 128-row decode step's LM head on oneDNN.
That kernel sums each output in one float32 accumulator over the inputs in order, so a
row's result is the same whatever rows it is multiplied with: a step computes each row's
products exactly as if it ran alone as long as it has at most `tile_rows` rows for every
weight (oneDNN's change in their last bits from 33 rows on): for the embedded model, a
decode step of up to 96 requests. Up to 32 rows that is also bit for bit what `F.linear`
gives. It costs a second copy of the weight, so it is a choice
(`EngineConfig.small_batch_kernel`).
"""

from __future__ import annotations

import torch

from kvray.cpu_ext import CSRC, CpuExtension, cpu_flags, kernels_enabled
from kvray.models import fused

_EXTENSION = CpuExtension(CSRC / "amx_linear.cpp")
# The most rows the tile kernel takes for a weight under so many bytes (its tile copy's,
# per rank); more rows go to oneDNN. See above for the measurements.
TILE_ROWS_BY_SIZE: tuple[tuple[float, int], ...] = (
    (4 << 20, 512),
    (16 << 20, 160),
    (float("inf"), 96),
)
# Up to this many rows the tile kernel's result is bit-identical to `F.linear`'s.
EXACT_ROWS = 32

# The row count oneDNN tunes the packed layout for; any row count works.
_BATCH_HINT = 128


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` would be packed: a 2-D CPU tensor, unless KVRAY_CPU_KERNELS=0, in
    bfloat16 where oneDNN has fast bfloat16 kernels, in float32 where it has not and the
    CPU has AVX2."""
    if not (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and kernels_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    if bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return weight.dtype == torch.bfloat16
    # float32 on x86 with AVX2 (measured there); other CPUs keep F.linear
    return weight.dtype == torch.float32 and "avx2" in cpu_flags()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of a [out, in] weight (`can_pack(weight)` must hold)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def can_tile(weight: torch.Tensor) -> bool:
    """Whether `weight` can get a tile-layout copy: packable bfloat16, an input size that is
    a multiple of 32, and a CPU (and OS) that gives this process the AMX tiles."""
    if weight.dtype != torch.bfloat16 or not can_pack(weight) or weight.shape[1] % 32 != 0:
        return False
    mod = _EXTENSION.load()
    return mod is not None and bool(mod.available())


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """The tile-layout copy of a [out, in] weight (`can_tile(weight)` must hold)."""
    return _EXTENSION.load().pack_tiles(weight.detach())


def tile_rows(tiles: torch.Tensor) -> int:
    """The most rows `packed_linear` multiplies on these tiles (a weight's `pack_tiles`)."""
    size = tiles.numel() * tiles.element_size()
    return next(rows for limit, rows in TILE_ROWS_BY_SIZE if size < limit)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
    out_features: int = 0,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a weight packed by `pack`; x is [..., in]. With the
    weight's `tiles` (and its `out_features`), products of up to `tile_rows(tiles)` rows run
    on them."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tiles is not None and rows <= tile_rows(tiles):
        flat = x.reshape(rows, x.shape[-1])
        out = _EXTENSION.load().linear_tiles(flat, tiles, out_features, bias)
        return out.reshape(*x.shape[:-1], out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def silu_mul_tiles(x: torch.Tensor, tiles: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """`fused.silu_mul(packed_linear(x, ..., tiles, 2 * intermediate))` for a [gate | up]
    weight's tiles, its bits, in one pass: each block of gate and of up is computed from
    the same rows of x and goes straight into silu(gate) * up, without the [rows, 2 I]
    product between them. None where the tiles would not serve those rows, or the
    intermediate size is not a multiple of 32 (the caller then runs the two steps)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    table = fused.silu_table()
    if intermediate % 32 != 0 or rows > tile_rows(tiles) or table is None:
        return None
    out = _EXTENSION.load().silu_mul_tiles(x.reshape(rows, x.shape[-1]), tiles, intermediate, table)
    return out.reshape(*x.shape[:-1], intermediate)
