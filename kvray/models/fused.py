"""Fused elementwise ops of the Llama family for CPUs: a small C++ kernel built on first use.

A CPU decode step spends a large share of its time in tiny torch ops, each reading and
writing a whole activation (RMSNorm alone is eight of them). Each op here is one pass over
the data with AVX-512, rows split over the cores by `at::parallel_for`:

    rms_norm(x, weight, eps)                 RMSNorm over the last dim (any leading dims)
    add_rms_norm(x, residual, weight, eps)   (rms_norm(x + residual), x + residual)
    silu_mul(gate_up)                        silu(gate) * up for gate_up = [gate | up]
    rotary(x, cos, sin)                      rotate-half rope of x [T, H, D], IN PLACE

They give the torch expressions they replace (the `*_reference` functions, also the
fallback) bit for bit, in bfloat16 and float32, as tests/test_fused_ops.py checks:

- each step rounds where torch rounds: a bfloat16 op is computed in float32 and rounded to
  nearest even (denormals kept), as ATen does;
- RMSNorm's sum of squares adds in the order of ATen's CPU sum (its cascade sum over 8-lane
  vectors: ATen runs its AVX2 sum kernel even on AVX-512 machines), then divides by n;
- SiLU uses ATen's exp: SLEEF's `expf16_u10` on the vectorised part of a row, the C
  library's `expf` on the tail ATen leaves to its scalar loop.

Limits of that claim: it is checked against ATen's default CPU dispatch (forcing another
one with ATEN_CPU_CAPABILITY changes ATen's summation order and vector steps); and float32
SiLU can still differ in the last bit where ATen splits a row whose length is not a
multiple of 32 between threads, which model sizes never are.

On CPUs with AVX2 and FMA but not AVX-512, `fused_ops_avx2.cpp` gives the same ops in
float32 only (ATen's AVX2 build is then the reference: 8-lane sums, SLEEF's `expf8_u10`, a
row's SiLU split at a multiple of 16); `silu_table` is None there and bfloat16 takes the
references.

Each op falls back to its reference when the kernel is unavailable (no compiler, no AVX2,
or `KVRAY_CPU_KERNELS=0`), for tensors off the CPU, other dtypes (float16), a last dim that
is not contiguous, and anything autograd must see; so GPU code paths are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kvray.cpu_ext import CSRC, CpuExtension

_EXTENSION = CpuExtension(CSRC / "fused_ops.cpp", ["-ffp-contract=off"])
# Where AVX-512 is missing but AVX2 and FMA are not: the same ops in float32 (8-lane vectors,
# ATen's AVX2 order), the dtype kvray serves in there; bfloat16 takes the references.
AVX2_EXTENSION = CpuExtension(
    CSRC / "fused_ops_avx2.cpp",
    ["-ffp-contract=off"],
    requires=("avx2", "fma"),
    excludes=("avx512f",),
)


def available() -> bool:
    return _mod() is not None


def kernel_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the kernel serves on this CPU (none where it is unavailable)."""
    if _EXTENSION.load() is not None:
        return frozenset({torch.bfloat16, torch.float32})
    return frozenset({torch.float32}) if AVX2_EXTENSION.load() is not None else frozenset()


def _mod() -> Any:
    """The kernel module for this CPU, or None where none can be built (one check each,
    then cached)."""
    return _EXTENSION.load() or AVX2_EXTENSION.load()


# -- torch references: the expressions the kernels reproduce, and the fallback ----------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, round to x's dtype, times weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token angles (cos/sin [T, D]), rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# -- the ops: the kernel where it serves the inputs (it returns None where it does not: off
# the CPU, another dtype, a last dim that is not contiguous, autograd), else the reference ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference(x, weight, eps)` over the last dim of x [..., D]; a new tensor."""
    if x.is_cpu and (mod := _mod()) is not None:
        out = mod.rms_norm(x, weight, eps)
        if out is not None:
            return out
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): two new tensors, the sum rounded to x's dtype
    as torch's `x + residual` rounds it. x and residual: [..., D], one shape."""
    if x.is_cpu and (mod := _mod()) is not None:
        out = mod.add_rms_norm(x, residual, weight, eps)
        if out is not None:
            return out
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up] (as `gate_up_proj` returns it);
    a new [T, I] tensor."""
    if gate_up.is_cpu and (mod := _mod()) is not None:
        out = mod.silu_mul(gate_up)
        if out is not None:
            return out
    return silu_mul_reference(gate_up)


@functools.cache
def silu_table() -> torch.Tensor | None:
    """float32 [65536]: `silu_mul`'s rounded silu of every bfloat16 gate, by its bits (for a
    kernel that fuses silu_mul into the product before it); None without the kernels."""
    mod = _mod()
    return None if mod is None else mod.silu_table()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for x [S, V]: int64 [S], the first index of each row's maximum
    (of its first NaN, if any). The kernel reads bf16 rows as they are, without a float32
    copy, at several times ATen's speed."""
    if x.is_cpu and (mod := _mod()) is not None:
        out = mod.argmax_rows(x)
        if out is not None:
            return out
    return x.argmax(dim=-1)


def mask_rows_(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """For each listed row r of x [S, V]: x[r, j] = -inf wherever bit j of bitmask[r]
    (int32 words, bit j % 32 of word j // 32) is 0; in place. A grammar's token mask, as
    xgrammar's `apply_token_bitmask_inplace` applies it, at memory speed on bf16 too.
    False when the kernel does not serve the input (the caller applies it otherwise)."""
    if x.is_cpu and (mod := _mod()) is not None:
        return bool(mod.mask_rows_(x, bitmask, rows))
    return False


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary_reference(x, cos, sin)` for x [T, H, D], cos/sin [T, D].

    The kernel rotates x IN PLACE and returns it; the fallback returns a new tensor and
    leaves x as it was. So the caller must own x (nothing may still need its unrotated
    values) and must use the returned tensor, not x."""
    if x.is_cpu and (mod := _mod()) is not None:
        out = mod.rotary_(x, cos, sin)
        if out is not None:
            return out
    return rotary_reference(x, cos, sin)
