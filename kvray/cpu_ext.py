"""The C++ CPU kernels' common loader: compiled on first use, once per process.

The kernels are real source files in `kvray/csrc/` (each ends with its pybind11 module
definition), shipped with the package. The first `load()` compiles one with torch's
`cpp_extension.load`, under a name that carries a hash of its source, the headers beside
it, its flags, the torch version and install, and the CPU it is compiled for
(`-march=native`): an edited source or header, or another CPU, is a new build, never a stale
or illegal binary, and later processes only load what torch cached under
~/.cache/torch_extensions (or TORCH_EXTENSIONS_DIR). Another venv's torch builds its own
copy instead of rebuilding this one's in place.
Where it cannot be built (a CPU without the instruction sets its kernels need, no compiler
or ninja) or `KVRAY_CPU_KERNELS=0` is set, `load()` returns None and callers keep to their
plain path.

torch serialises builds with a `lock` file in the build directory, and every load (an
up-to-date one too) waits for it to go away: a process killed while it compiled (Ctrl-C on
a server's first start) leaves one behind, and every later load would wait forever. A lock
older than STALE_LOCK_S, far longer than any of these builds takes, is removed first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# A build lock this old was left by a build that died (one takes well under a minute here).
STALE_LOCK_S = 600.0


def kernels_enabled() -> bool:
    """False when the user turned kvray's CPU kernels off (KVRAY_CPU_KERNELS=0)."""
    return os.environ.get("KVRAY_CPU_KERNELS", "1") != "0"


@cache
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The first CPU's instruction-set flags, as /proc/cpuinfo names them."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_has_avx512() -> bool:
    return "avx512f" in cpu_flags()


@cache
def cpu_identity() -> str:
    """The CPU's model name and instruction-set flags: what `-march=native` compiles for."""
    fields: dict[str, str] = {}
    for line in _cpuinfo().splitlines():  # the first CPU's lines
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("vendor_id", "model name", "flags"):
            fields.setdefault(key, value)
    return "\n".join(f"{k}={v}" for k, v in sorted(fields.items()))


# Where kvray's kernels are: a module holding a CpuExtension as `_EXTENSION`, or
# "module:attribute" for another one.
KERNEL_MODULES = (
    "kvray.models.fused",
    "kvray.models.fused:AVX2_EXTENSION",
    "kvray.models.packed",
    "kvray.attention.cpu_paged",
    "kvray.attention.cpu_avx2",
    "kvray.workers.cpu_bind",
    "kvray.kvcache.cpu_store",
)


class CpuExtension:
    """One C++ source file (in `kvray/csrc`), built at most once per process (thread-safe),
    on CPUs with every instruction set of `requires` (cpuinfo's flag names; AVX-512 unless
    told otherwise) and none of `excludes` (where another build of the same kernels serves)."""

    def __init__(
        self,
        source: Path,
        extra_cflags: Sequence[str] = (),
        requires: Sequence[str] = ("avx512f",),
        excludes: Sequence[str] = (),
    ) -> None:
        self.source = source
        self.extra_cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self.requires = frozenset(requires)
        self.excludes = frozenset(excludes)
        self._lock = threading.Lock()
        self._module: Any = None
        self._tried = False

    def suits_cpu(self) -> bool:
        """Whether this CPU has every set the kernels require and none they exclude."""
        flags = cpu_flags()
        return self.requires <= flags and not self.excludes & flags

    def build_name(self) -> str:
        """The module's name: the file's stem and a hash of what the binary depends on (the
        source, the headers beside it, the flags, the torch version and install, the CPU)."""
        import torch

        digest = hashlib.sha256(self.source.read_bytes())
        for header in sorted(self.source.parent.glob("*.h")):  # what it may #include
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
        digest.update("\0".join([*self.extra_cflags, torch.__version__]).encode())
        # The torch install it compiles against: its include and library paths are in the
        # build's ninja file, so two environments sharing the cache (two venvs, a CI clone
        # beside a checkout) would otherwise each rebuild the other's binary at every switch.
        digest.update(str(Path(torch.__file__).resolve().parent).encode())
        # -march=native: a binary built on one CPU may not run on another (a shared home
        # or an image moved between hosts), so the CPU it targets is part of its name.
        digest.update(cpu_identity().encode())
        return f"kvray_{self.source.stem}_{digest.hexdigest()[:16]}"

    def load(self) -> Any:
        """The compiled module, or None where it cannot be built or is turned off."""
        if self._tried:  # the fast path of every call after the first
            return self._module
        with self._lock:
            if self._tried:
                return self._module
            if kernels_enabled() and self.suits_cpu():
                try:
                    from torch.utils.cpp_extension import load

                    name = self.build_name()
                    self._clear_stale_lock(name)
                    self._module = load(
                        name=name,
                        sources=[str(self.source)],
                        extra_cflags=self.extra_cflags,
                        extra_ldflags=["-fopenmp"],
                    )
                except Exception as e:  # noqa: BLE001 - the torch path serves instead
                    log.warning("kvray CPU kernel %s unavailable (%s); using torch", self.source, e)
            self._tried = True
            return self._module

    def available(self) -> bool:
        return self.load() is not None

    def is_built(self) -> bool:
        """Whether torch's cache holds this build's binary, so that a load only loads it
        (the name changes with everything the binary depends on: see `build_name`)."""
        name = self.build_name()
        return (self.build_dir(name) / f"{name}.so").is_file()

    def require(self) -> Any:
        """The compiled module; RuntimeError where it cannot be built or is turned off."""
        mod = self.load()
        if mod is None:
            raise RuntimeError(f"kvray's {self.source.name} kernels are not available here")
        return mod

    def build_dir(self, name: str | None = None) -> Path:
        """Where torch builds and caches this module (TORCH_EXTENSIONS_DIR or its default);
        `name`: its `build_name()`, where the caller has it already."""
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name or self.build_name(), verbose=False))

    def _clear_stale_lock(self, name: str | None = None) -> None:
        lock = self.build_dir(name) / "lock"
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            return  # no lock: nothing to clear
        if age > STALE_LOCK_S:
            log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink(missing_ok=True)


def extension(where: str) -> CpuExtension:
    """The CpuExtension a KERNEL_MODULES entry names."""
    import importlib

    module, _, attribute = where.partition(":")
    ext: CpuExtension = getattr(importlib.import_module(module), attribute or "_EXTENSION")
    return ext


def _build(where: str) -> tuple[str, bool]:
    ext = extension(where)
    return ext.source.name, ext.available()


def build_all(jobs: int = 2, modules: Sequence[str] = KERNEL_MODULES) -> dict[str, bool]:
    """Compile the kernels `modules` names (default: all), `jobs` at a time in processes
    of their own, into torch's extension cache, where every later process finds them (a
    server's workers then start without compiling). Returns which are available."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Fresh processes (spawn), not forks of this one, whatever threads it runs.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=spawn) as pool:
        return dict(pool.map(_build, modules))


def pending_builds() -> list[str]:
    """The KERNEL_MODULES entries this CPU runs whose binaries torch's cache lacks: what a
    process would compile, one at a time, as it first uses each (none where the kernels
    are turned off)."""
    if not kernels_enabled():
        return []
    return [
        where
        for where in KERNEL_MODULES
        if (ext := extension(where)).suits_cpu() and not ext.is_built()
    ]


if __name__ == "__main__":
    # Run as a script this file is `__main__`: the pool's children must find `_build` under
    # its importable name.
    from kvray import cpu_ext

    for name, ok in sorted(cpu_ext.build_all().items()):
        print(f"{name}: {'built' if ok else 'unavailable here'}")
