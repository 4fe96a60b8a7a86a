"""The physical KV pool: one tensor holding K and V of every layer."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Sequence

import torch

from kvray.kvcache import cpu_store
from kvray.kvcache.base import BaseKVCachePool, div_even
from kvray.kvcache.prefault import prefault_in_background

# Pages committed per chunk of the background prefault (each chunk is 2 x num_layers ranges).
PREFAULT_CHUNK_PAGES = 32


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On a CPU it lies in fresh private anonymous memory, which the
    kernel hands out zero-filled page by page as it is first written: `torch.zeros` wrote
    every byte of a 2 GiB pool at start (2.3 s of each engine start on a 2-core VM). So
    nothing is written at start; the pool commits the memory on a background thread
    (`kvray.kvcache.prefault`), and it is returned to the system with the tensor."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, device=device, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds a reference to the mapping, which is unmapped when both are gone.
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def page_chunks(buffer: torch.Tensor) -> Iterator[list[tuple[int, int]]]:
    """Byte ranges of a `(2, num_layers, num_pages, ...)` buffer: PREFAULT_CHUNK_PAGES pages
    of every layer's K and V at a time, from the highest pages down. (It keeps the shape,
    not the tensor: the prefault thread must not keep a dropped pool alive.)"""
    kv, layers, pages = buffer.shape[:3]
    page_bytes = math.prod(buffer.shape[3:]) * buffer.element_size()
    return (
        [
            (((i * layers + layer) * pages + lo) * page_bytes, (hi - lo) * page_bytes)
            for i in range(kv)
            for layer in range(layers)
        ]
        for hi in range(pages, 0, -PREFAULT_CHUNK_PAGES)
        for lo in (max(hi - PREFAULT_CHUNK_PAGES, 0),)
    )


class MHAKVCache(BaseKVCachePool):
    """K/V of all layers in one buffer of shape
    `(2, num_layers, num_pages, page_size, local_kv_heads, head_dim)`.

    `num_pages` counts every page in the buffer, the dummy page included (the caller adds
    one page beyond what the scheduler hands out). `tp_size` is explicit: each TP rank holds
    `div_even(num_kv_heads, tp_size, allow_replicate=True)` heads.
    """

    def __init__(
        self,
        num_kv_heads: int,
        num_layers: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_size: int = 1,
    ) -> None:
        local_kv_heads = div_even(num_kv_heads, tp_size, allow_replicate=True)
        # Zeroed, not empty: padded reads (the dummy page, masked tail slots) must never
        # see NaN/inf garbage, which a mask multiplies but cannot cancel.
        self._kv_buffer = zeroed(
            (2, num_layers, num_pages, page_size, local_kv_heads, head_dim), dtype, device
        )
        self._num_layers = num_layers
        self._k_buffer = self._kv_buffer[0]
        self._v_buffer = self._kv_buffer[1]
        self._storage_shape = (num_pages * page_size, local_kv_heads, head_dim)
        # Each layer's K and V as (slots, heads, head_dim), made once: every layer of every
        # step reads them.
        self._k_flat = [self._k_buffer[i].view(self._storage_shape) for i in range(num_layers)]
        self._v_flat = [self._v_buffer[i].view(self._storage_shape) for i in range(num_layers)]
        self._cpu = self._kv_buffer.device.type == "cpu"
        self.num_pages = num_pages
        self.page_size = page_size
        self.local_kv_heads = local_kv_heads
        self.head_dim = head_dim
        # A CPU pool's memory is committed in the background, highest page first: the
        # scheduler's free stack hands pages out from the top (scheduler/cache.py).
        self.prefault_thread = None
        if self._cpu:
            chunks = page_chunks(self._kv_buffer)
            self.prefault_thread = prefault_in_background(self._kv_buffer, chunks)

    def k_cache(self, index: int) -> torch.Tensor:
        return self._k_buffer[index]

    def v_cache(self, index: int) -> torch.Tensor:
        return self._v_buffer[index]

    def k_flat(self, index: int) -> torch.Tensor:
        """Layer `index`'s K as `(num_pages * page_size, local_kv_heads, head_dim)`."""
        return self._k_flat[index]

    def v_flat(self, index: int) -> torch.Tensor:
        return self._v_flat[index]

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
        """Write K/V of the step's tokens (`[T, local_kv_heads, head_dim]`) to slots `out_loc`."""
        k_pool, v_pool = self._k_flat[layer_id], self._v_flat[layer_id]
        if self._cpu and cpu_store.store(k_pool, v_pool, k, v, out_loc):
            return
        idx = out_loc.to(device=self._kv_buffer.device, dtype=torch.long)
        k_pool.index_copy_(0, idx, k.to(self.dtype))
        v_pool.index_copy_(0, idx, v.to(self.dtype))

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of whole pages' K/V, all layers: `(2, num_layers, len(pages), page_size,
        local_kv_heads, head_dim)`, on the CPU (to leave this process)."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self._kv_buffer.device)
        return self._kv_buffer.index_select(2, idx).cpu()

    def write_pages(self, pages: Sequence[int], kv: torch.Tensor) -> None:
        """Overwrite whole pages with K/V laid out as `read_pages` returns it."""
        want = (*self._kv_buffer.shape[:2], len(pages), *self._kv_buffer.shape[3:])
        if tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise ValueError(f"K/V of shape {tuple(kv.shape)} {kv.dtype}, need {want} {self.dtype}")
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self._kv_buffer.device)
        self._kv_buffer.index_copy_(2, idx, kv.to(self._kv_buffer.device))

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return tuple(self._kv_buffer.shape)

    @property
    def device(self) -> torch.device:
        return self._kv_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._num_layers
