"""Committing a CPU pool's memory in the background, ahead of the steps that write it.

A CPU pool lies in fresh anonymous memory (`mha_pool.zeroed`) so that an engine starts at
once; but then every 4 KiB page is faulted in by the first step that stores K/V into it.
On a VM a first touch is expensive (the host backs the page too): in the offline bench on
a 2-core VM, `store_kv` took 2.3 s of a 50 s run this way, against 0.24 s with the pool
committed. So a thread asks the kernel to commit the pages (`madvise(MADV_POPULATE_WRITE)`,
which writes nothing: the pages stay zero, and a step may store into them meanwhile) in
the order the scheduler hands them out, and stops when the pool is dropped. 2 GiB take
1-2 s on that VM, 8-10 s while Ray and Serve start beside it.

It runs at the process's own priority. At nice 19 it took twice as long in a served
worker, and while it ran every served step was slower (TTFT +86 ms p50 in `kvray bench
overhead`), most likely waiting for the memory-map lock that the starved thread held.
Where the kernel cannot (before Linux 5.14, another OS), the steps fault the pages in as
before: this only moves work, it never changes what a step computes.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Iterable

import torch

_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+
_PAGE = 4096


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def supported() -> bool:
    """Whether this kernel commits memory on request (MADV_POPULATE_WRITE, Linux 5.14+)."""
    madvise = _madvise()
    if madvise is None:
        return False
    probe = torch.empty(_PAGE * 2, dtype=torch.uint8)
    start = (probe.data_ptr() + _PAGE - 1) // _PAGE * _PAGE
    return bool(madvise(start, _PAGE, _MADV_POPULATE_WRITE) == 0)


def prefault_in_background(
    buffer: torch.Tensor, chunks: Iterable[list[tuple[int, int]]], name: str = "kvray-prefault"
) -> threading.Thread | None:
    """Commit `buffer`'s memory, chunk by chunk, on a daemon thread; each chunk
    is a list of (byte offset, byte length) ranges of the buffer. Returns the thread, or
    None where the platform cannot. The thread holds the buffer only while it commits one
    chunk: once the pool lets go of it, the thread ends at the next chunk."""
    madvise = _madvise()
    if madvise is None or buffer.device.type != "cpu" or buffer.numel() == 0:
        return None
    ref = weakref.ref(buffer)

    def run() -> None:
        for chunk in chunks:
            held = ref()
            if held is None:
                return
            base = held.data_ptr()
            for offset, length in chunk:
                start = (base + offset) // _PAGE * _PAGE  # madvise takes whole pages
                if madvise(start, base + offset + length - start, _MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel (EINVAL) or no memory to commit: leave it to the steps
            del held

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
