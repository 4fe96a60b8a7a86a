"""Pinning a CPU worker's torch threads, one per core, on cores no other worker holds.

A CPU worker computes with an OpenMP team of `torch.get_num_threads()` threads that meet
at a barrier after every op, so one thread held up holds up the step. On a server the
serving processes (ingress, scheduler, Ray's own) run on the same cores. Left to float, the
kernel moves team threads around them, at times two onto one core; pinned, each thread
keeps its core and only waits out the interruption (`kvray bench serve` at 1 req/s on 2
cores, four pairs of runs: decode steps 3-11% shorter, TTFT p50 0-13% lower). vLLM and
SGLang pin their CPU workers' threads too.

Cores are claimed per node through lock files (`flock`) in a per-user directory under the
temp dir. A worker holds its cores' locks for its life and the kernel drops them when the
process ends, however it ends; the next worker (another TP rank, another replica) takes
other cores or, where too few are free, does not pin at all. Two workers never share a
pinned core.

Nothing is pinned where the cores are shared in a way the locks cannot see: a cgroup CPU
quota below the CPUs this process may run on (a Kubernetes CPU limit without a dedicated
cpuset: other pods run on the same cores).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvray.cpu_ext import CSRC, CpuExtension

log = logging.getLogger(__name__)

SYSFS_CPUS = Path("/sys/devices/system/cpu")
LOCK_DIR = Path(tempfile.gettempdir()) / f"kvray-cpus-{os.getuid()}"
CGROUP_ROOT = Path("/sys/fs/cgroup")

_EXTENSION = CpuExtension(CSRC / "omp_bind.cpp", requires=())


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_order(cpus: Iterable[int], sysfs: Path = SYSFS_CPUS) -> list[int]:
    """`cpus` in the order workers claim them: every physical core's first hardware thread
    before any core's second (two busy threads on one core compete for its units), and
    within that by NUMA node, then by number."""

    def key(cpu: int) -> tuple[int, int, int]:
        base = sysfs / f"cpu{cpu}"
        try:
            siblings = parse_cpu_list((base / "topology" / "thread_siblings_list").read_text())
            smt = siblings.index(cpu)
        except (OSError, ValueError):
            smt = 0
        nodes = sorted(int(p.name[4:]) for p in base.glob("node[0-9]*"))
        return smt, nodes[0] if nodes else 0, cpu

    return sorted(set(cpus), key=key)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs this process's cgroup may use by its CFS quota (quota / period), or None
    where no quota is set or none can be read (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`)."""
    dirs: list[Path] = []
    for line in (_read(proc_cgroup) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if not controllers:  # v2: one hierarchy
            dirs.append(root / rel)
        elif "cpu" in controllers.split(","):
            dirs += [root / controllers / rel, root / "cpu" / rel]
    dirs += [root, root / "cpu"]  # in a container's cgroup namespace, its own is the root
    for d in dirs:
        if (v2 := _read(d / "cpu.max")) is not None:
            quota, period = v2.split()[:2]
        elif (v1 := _read(d / "cpu.cfs_quota_us")) and (p := _read(d / "cpu.cfs_period_us")):
            quota, period = v1, p
        else:
            continue
        return None if quota in ("max", "-1") else int(quota) / int(period)
    return None


@dataclass
class CpuClaim:
    """Cores this process holds the locks of, until `release()` or its end."""

    cpus: tuple[int, ...]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing drops the flock
        self._fds.clear()


def claim_cpus(n: int, allowed: Iterable[int], lock_dir: Path = LOCK_DIR) -> CpuClaim | None:
    """Lock `n` of the `allowed` cores, first free first in `cpu_order`; None (holding
    nothing) where fewer than `n` are free."""
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    claim = CpuClaim(())
    cpus: list[int] = []
    for cpu in cpu_order(allowed):
        if len(cpus) == n:
            break
        fd = os.open(lock_dir / f"cpu{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        claim._fds.append(fd)
        cpus.append(cpu)
    if len(cpus) < n:
        claim.release()
        return None
    claim.cpus = tuple(cpus)
    return claim


# libgomp's idle team threads spin this many rounds before they sleep (its default, 300000
# rounds of PAUSE, is milliseconds here). Between a served worker's steps that spin holds a
# core while the scheduler plans the next step and the ingress streams the last one's
# tokens on the same cores; shorter, the idle thread sleeps within about a millisecond and
# only the step's first region waits for its wake-up. `kvray bench overhead` against
# servers taking turns (2 cores, 16 requests a run, 4 runs each): ITL p50 added 1.6-1.8 ms
# against 2.0-2.6 ms with the default, TTFT p50 added 2.3-7.2 against 4.9-8.8 ms.
WORKER_SPIN_COUNT = 20000


def worker_omp_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """OpenMP settings a CPU worker actor starts with (libgomp reads them when it loads):
    GOMP_SPINCOUNT as above, unless `env` sets it or OMP_WAIT_POLICY already."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return {}
    return {"GOMP_SPINCOUNT": str(WORKER_SPIN_COUNT)}


def release_omp_team() -> bool:
    """End the calling thread's OpenMP worker threads (see omp_bind.cpp's release_team):
    call it on a thread that computed before (loading a model) once another thread does
    the steps. False where the extension is unavailable or the runtime refused."""
    mod = _EXTENSION.load()
    return mod is not None and mod.release_team() == 0


class ThreadBinding:
    """One worker's pinned OpenMP team: claims `threads` cores once, then `ensure()` pins
    the team of whichever thread runs the steps (called on that thread before each)."""

    def __init__(self, threads: int, lock_dir: Path = LOCK_DIR) -> None:
        self.claim: CpuClaim | None = None
        self._pinned: set[int] = set()
        self._lock = threading.Lock()
        allowed = sorted(os.sched_getaffinity(0))
        limit = cgroup_cpu_limit()
        if limit is not None and limit < len(allowed):
            log.info(
                "not pinning torch threads: a cgroup quota of %.3g CPUs over %d cores means "
                "they are shared",
                limit,
                len(allowed),
            )
            return
        if _EXTENSION.load() is None:
            log.info("not pinning torch threads: kvray's C++ extensions are unavailable")
            return
        self.claim = claim_cpus(threads, allowed, lock_dir)
        if self.claim is None:
            log.info("not pinning torch threads: fewer than %d free cores on this node", threads)

    @property
    def cpus(self) -> tuple[int, ...]:
        """The cores claimed (empty where nothing is pinned)."""
        return self.claim.cpus if self.claim is not None else ()

    def ensure(self) -> None:
        """Pin the calling thread's team, once per thread."""
        me = threading.get_ident()
        if self.claim is None or me in self._pinned:
            return
        with self._lock:
            status = _EXTENSION.load().bind_team(list(self.claim.cpus))
            self._pinned.add(me)
        if any(status):
            log.warning("pinning torch threads to %s: statuses %s", self.claim.cpus, status)
