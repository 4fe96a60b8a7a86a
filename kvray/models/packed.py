"""Linear weights prepacked for oneDNN, for bfloat16 on CPUs.

`F.linear` on a CPU hands oneDNN a plain row-major weight, which it reorders into its
blocked layout on every call. Packing once at load time skips that: about 8% of a 128-token
bf16 decode step here. The packed product is bit-identical to `F.linear` in bfloat16 for any
number of rows (checked in tests/test_packed_linear.py); float32 would not be (oneDNN picks
another summation order), so float32, the correctness-oracle dtype, is never packed.

A packed weight is an opaque oneDNN tensor: it only feeds `packed_linear`.
"""

from __future__ import annotations

import torch

from kvray.cpu_ext import kernels_enabled

# The row count oneDNN tunes the packed layout for; any row count works.
_BATCH_HINT = 128


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` would be packed: a bf16 CPU tensor, with oneDNN bf16 support,
    unless KVRAY_CPU_KERNELS=0."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and kernels_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of a [out, in] weight (`can_pack(weight)` must hold)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a weight packed by `pack`; x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
