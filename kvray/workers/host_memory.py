"""A CPU worker's heap: large, short-lived tensors kept mapped instead of fresh mmaps, and
tcmalloc preloaded where the system has it.

glibc serves an allocation above its mmap threshold with a new mapping and unmaps it on
free, so every step's activations (a prefill chunk's MLP input alone is tens of MB) are
page-faulted and zeroed by the kernel again, step after step: measured here, ~3x the minor
page faults and a prefill step up to 30% slower. Raising the threshold to glibc's maximum
and never trimming the heap's top keeps that memory mapped for the next step, as tcmalloc
(which vLLM's CPU build preloads) does. The price is that the process keeps its peak step
working set resident, which a serving process reaches again at its next large step anyway.

tcmalloc does better still: its per-thread caches serve the step's many mid-sized tensors
without glibc's locks and bins, and it maps large ones once. Preloaded (it must be there
when the process starts: `LD_PRELOAD`), the embedded model's offline bench ran 4-7% faster
here (738 / 768 against 713 / 720 output tok/s, runs taking turns) and a 256-token prefill
step 6% shorter. kvray preloads it into the processes that run models, where Debian's
libtcmalloc-minimal4 (or another tcmalloc) is installed, unless KVRAY_TCMALLOC=0
(KVRAY_TCMALLOC=/path/to/libtcmalloc.so names one elsewhere):
`preload_env()` is what a CPU worker actor is started with, and the CLI re-executes
itself with it for commands that run the engine in process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Mapping

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


TCMALLOC_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


@functools.cache
def _installed_tcmalloc() -> str | None:
    for directory in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    return None


def tcmalloc_path(env: Mapping[str, str] = os.environ) -> str | None:
    """The tcmalloc to preload: KVRAY_TCMALLOC's path if it names one, None if it is 0,
    else the first installed in the usual places (or None)."""
    choice = env.get("KVRAY_TCMALLOC", "")
    if choice == "0":
        return None
    if choice not in ("", "1"):
        return choice
    return _installed_tcmalloc()


def preload_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables that start a process with tcmalloc preloaded: {"LD_PRELOAD": ...}
    (tcmalloc before whatever `env` preloads already), or {} where there is none
    (`tcmalloc_path`) or it is preloaded already."""
    path = tcmalloc_path(env)
    preload = env.get("LD_PRELOAD", "")
    if path is None:
        return {}
    names = {os.path.basename(path), *TCMALLOC_NAMES}
    if any(os.path.basename(p) in names for p in preload.replace(" ", ":").split(":")):
        return {}
    return {"LD_PRELOAD": ":".join(p for p in (path, preload) if p)}


# Set in the environment of a process that re-executed itself with tcmalloc: what it
# preloaded before (so children that should not inherit tcmalloc can be given that back).
PRELOAD_BEFORE = "KVRAY_LD_PRELOAD_BEFORE"


def reexec_with_tcmalloc() -> None:
    """Replace this process by the same command line with tcmalloc preloaded, where
    `preload_env()` says it is wanted and missing; else return. Once only: the new process
    finds PRELOAD_BEFORE set."""
    extra = preload_env()
    if not extra or PRELOAD_BEFORE in os.environ:
        return
    env = {**os.environ, **extra, PRELOAD_BEFORE: os.environ.get("LD_PRELOAD", "")}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def env_without_added_preload(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with LD_PRELOAD as it was before `reexec_with_tcmalloc` (for a child that
    starts processes of its own, such as a Ray cluster, which should not all get it)."""
    out = dict(env)
    if PRELOAD_BEFORE in out:
        before = out.pop(PRELOAD_BEFORE)
        if before:
            out["LD_PRELOAD"] = before
        else:
            out.pop("LD_PRELOAD", None)
    return out
