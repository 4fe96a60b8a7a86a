"""Keeps a CPU worker's large, short-lived tensors in the heap instead of fresh mmaps.

glibc serves an allocation above its mmap threshold with a new mapping and unmaps it on
free, so every step's activations (a prefill chunk's MLP input alone is tens of MB) are
page-faulted and zeroed by the kernel again, step after step: measured here, ~3x the minor
page faults and a prefill step up to 30% slower. Raising the threshold to glibc's maximum
and never trimming the heap's top keeps that memory mapped for the next step, as tcmalloc
(which vLLM's CPU build preloads) does. The price is that the process keeps its peak step
working set resident, which a serving process reaches again at its next large step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_large_allocations() -> bool:
    """Tune this process's glibc malloc as above (once). Returns whether it applied: False
    off Linux or glibc (e.g. musl), where nothing is changed."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok: bool = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok
