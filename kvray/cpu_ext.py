"""The C++ CPU kernels' common loader: compiled on first use, once per process.

A kernel module (`kvray.attention.cpu_decode`, `kvray.models.fused`) holds its C++ source
and a `CpuExtension`; the first `load()` compiles it with torch's `load_inline` (cached by
torch under ~/.cache/torch_extensions, so later processes only load it). Where it cannot be
built (no AVX-512, no compiler or ninja) or `KVRAY_CPU_KERNELS=0` is set, `load()` returns
None and callers keep to their plain torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

log = logging.getLogger(__name__)


def kernels_enabled() -> bool:
    """False when the user turned kvray's CPU kernels off (KVRAY_CPU_KERNELS=0)."""
    return os.environ.get("KVRAY_CPU_KERNELS", "1") != "0"


@cache
def cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


class CpuExtension:
    """One inline C++ extension for AVX-512 CPUs, built at most once (thread-safe)."""

    def __init__(
        self, name: str, source: str, functions: Sequence[str], extra_cflags: Sequence[str] = ()
    ) -> None:
        self.name = name  # bump it when the source changes: torch caches builds by name
        self.source = source
        self.functions = list(functions)
        self.extra_cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self._lock = threading.Lock()
        self._module: Any = None
        self._tried = False

    def load(self) -> Any:
        """The compiled module, or None where it cannot be built or is turned off."""
        if self._tried:  # the fast path of every call after the first
            return self._module
        with self._lock:
            if self._tried:
                return self._module
            if kernels_enabled() and cpu_has_avx512():
                try:
                    from torch.utils.cpp_extension import load_inline

                    self._module = load_inline(
                        name=self.name,
                        cpp_sources=self.source,
                        functions=self.functions,
                        extra_cflags=self.extra_cflags,
                        extra_ldflags=["-fopenmp"],
                    )
                except Exception as e:  # noqa: BLE001 - the torch path serves instead
                    log.warning("kvray CPU kernel %s unavailable (%s); using torch", self.name, e)
            self._tried = True
            return self._module

    def available(self) -> bool:
        return self.load() is not None
