"""Attention backends that write and read an `MHAKVCache` during the forward pass."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from kvray.attention.base import AttentionBackend, AttnMetadata
from kvray.kvcache.mha_pool import MHAKVCache
from kvray.registry import Registry

BackendFactory = Callable[[MHAKVCache, int, int, float], AttentionBackend]
ATTENTION_BACKENDS: Registry[BackendFactory] = Registry("attention backend")


def _lazy(module: str, name: str) -> BackendFactory:
    """A factory that imports the backend's module only when one is built (flash-attn and
    Triton are imported by their backends alone), then calls `name` there (a backend class,
    or a function that picks one)."""

    def create(
        kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
    ) -> AttentionBackend:
        backend: AttentionBackend = getattr(importlib.import_module(module), name)(
            kvcache, num_q_heads_local, head_dim, scale
        )
        return backend

    return create


for _name, (_module, _factory) in {
    "torch": ("kvray.attention.torch_backend", "TorchAttentionBackend"),
    "cpu": ("kvray.attention.cpu_backend", "create"),
    "triton": ("kvray.attention.triton_backend", "TritonAttentionBackend"),
    "flash_attn": ("kvray.attention.flash_attn_backend", "FlashAttnBackend"),
}.items():
    ATTENTION_BACKENDS.register(_name)(_lazy(_module, _factory))


def resolve_backend_name(name: str, kvcache: MHAKVCache, head_dim: int) -> str:
    """Resolve "auto". On CUDA: "flash_attn" when it is installed and the page size suits
    its paged kernel (a multiple of 256), else "triton" (else "torch" if Triton is
    missing). On CPUs: "cpu" where its kernels serve the pool, else "torch". Other
    names pass through unchanged."""
    if name != "auto":
        return name
    if kvcache.device.type != "cuda":
        from kvray.attention import cpu_backend

        return "cpu" if cpu_backend.supports(kvcache, head_dim) else "torch"
    if importlib.util.find_spec("flash_attn") is not None:
        from kvray.attention.flash_attn_backend import PAGE_MULTIPLE

        if kvcache.page_size % PAGE_MULTIPLE == 0:
            return "flash_attn"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def backend_names() -> list[str]:
    """Choices for a CLI / config: "auto" plus every registered backend."""
    return ["auto", *ATTENTION_BACKENDS.names()]


def create_attention_backend(
    name: str, kvcache: MHAKVCache, num_q_heads_local: int, head_dim: int, scale: float
) -> AttentionBackend:
    factory = ATTENTION_BACKENDS.get(resolve_backend_name(name, kvcache, head_dim))
    return factory(kvcache, num_q_heads_local, head_dim, scale)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttnMetadata",
    "backend_names",
    "create_attention_backend",
    "resolve_backend_name",
]
