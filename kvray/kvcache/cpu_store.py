"""`store_kv` for CPU pools in one C++ call per layer (`kvray/csrc/kv_store.cpp`): a
memcpy per row where ATen's `index_copy_` spent most of its 7-40 us a call (two a layer)
on its own setup, about a millisecond of every small decode step of the embedded model."""

from __future__ import annotations

import torch

from kvray.cpu_ext import CSRC, CpuExtension

_EXTENSION = CpuExtension(CSRC / "kv_store.cpp", requires=())


def store(
    k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor
) -> bool:
    """k/v [T, H, D] into rows `loc` of k_pool/v_pool [slots, H, D]; False (nothing
    written) where the kernel does not serve these inputs (not built, another device or
    dtype, rows that are not contiguous)."""
    mod = _EXTENSION.load()
    return mod is not None and bool(mod.store_kv(k_pool, v_pool, k, v, loc))
