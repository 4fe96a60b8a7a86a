"""Pinning CPU workers' torch threads (kvray.workers.cpu_bind): which cores are claimed,
that two claimants never share one, that a dead claimant's cores come free, and that the
threads torch then computes on are the pinned ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvray.workers import cpu_bind
from kvray.workers.cpu_bind import cgroup_cpu_limit, claim_cpus, cpu_order, parse_cpu_list


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def _fake_sysfs(root: Path, siblings: dict[int, str], node: dict[int, int]) -> Path:
    for cpu, sib in siblings.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(sib + "\n")
        (root / f"cpu{cpu}" / f"node{node[cpu]}").mkdir()
    return root


def test_physical_cores_first_then_numa_node(tmp_path) -> None:
    """Two nodes of two cores with two hardware threads each (Linux numbers the second
    threads after all first ones)."""
    siblings = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}
    node = {0: 0, 1: 0, 4: 0, 5: 0, 2: 1, 3: 1, 6: 1, 7: 1}
    sysfs = _fake_sysfs(tmp_path, siblings, node)
    assert cpu_order(range(8), sysfs) == [0, 1, 2, 3, 4, 5, 6, 7]
    # Numbered the other way (siblings adjacent), still one thread per core first.
    siblings = {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}
    sysfs = _fake_sysfs(tmp_path / "b", siblings, {c: 0 for c in siblings})
    assert cpu_order([3, 2, 1, 0], sysfs) == [0, 2, 1, 3]
    assert cpu_order([2, 3], tmp_path / "missing") == [2, 3]  # no topology: by number


def test_claims_never_share_a_core(tmp_path) -> None:
    first = claim_cpus(2, [0, 1, 2], tmp_path)
    assert first is not None and first.cpus == (0, 1)
    assert claim_cpus(2, [0, 1, 2], tmp_path) is None  # one core free: no partial claim
    second = claim_cpus(1, [0, 1, 2], tmp_path)
    assert second is not None and second.cpus == (2,)
    first.release()
    third = claim_cpus(2, [0, 1, 2], tmp_path)
    assert third is not None and third.cpus == (0, 1)
    second.release()
    third.release()


def test_a_dead_claimants_cores_come_free(tmp_path) -> None:
    """The locks are the process's: killed without any cleanup, its cores are free."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from kvray.workers.cpu_bind import claim_cpus\n"
            f"c = claim_cpus(2, [0, 1], Path({str(tmp_path)!r}))\n"
            "print(c.cpus, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "(0, 1)"
        assert claim_cpus(1, [0, 1], tmp_path) is None
    finally:
        holder.kill()
        holder.wait()
    claim = claim_cpus(2, [0, 1], tmp_path)
    assert claim is not None and claim.cpus == (0, 1)
    claim.release()


def test_cgroup_quota(tmp_path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "cgroup_v2"
    proc.write_text("0::/pod\n")
    assert cgroup_cpu_limit(v2, proc) == 1.5
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "job").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/job\n")
    assert cgroup_cpu_limit(v1, proc) == 2.0
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1, proc) is None
    assert cgroup_cpu_limit(tmp_path / "none", tmp_path / "no_such_file") is None


PINNED_RUN = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch
    from kvray.workers.cpu_bind import ThreadBinding

    def cpu_ticks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = int(fields[11]) + int(fields[12])
        return out

    def allowed(tid):
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("Cpus_allowed_list"):
                return line.split()[1]

    torch.set_num_threads(2)
    binding = ThreadBinding(2, Path(sys.argv[1]))
    binding.ensure()
    binding.ensure()  # once per thread: a second call changes nothing
    a = torch.randn(1024, 1024)
    before = cpu_ticks()
    for _ in range(60):
        a @ a
    after = cpu_ticks()
    busy = [t for t, n in after.items() if n - before.get(t, 0) >= 10]
    print(json.dumps({
        "cpus": list(binding.cpus),
        "caller": allowed(os.getpid()),
        "busy": sorted(allowed(t) for t in busy),
    }))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two threads")
def test_torch_computes_on_the_pinned_threads(tmp_path) -> None:
    """In a process of its own (pinning is for life): the caller is pinned to the first
    core, and the threads that then do torch's work are pinned one per claimed core."""
    import json

    if cpu_bind._EXTENSION.load() is None:
        pytest.skip("kvray's C++ extensions cannot be built here")
    out = subprocess.run(
        [sys.executable, "-c", PINNED_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    allowed = os.sched_getaffinity(0)
    limit = cgroup_cpu_limit()
    if limit is not None and limit < len(allowed):  # cores shared through a quota
        assert got["cpus"] == []
        for threads in [got["caller"], *got["busy"]]:
            assert parse_cpu_list(threads) == sorted(allowed)
        return
    first, second = cpu_order(allowed)[:2]
    assert got["cpus"] == [first, second]
    assert got["caller"] == str(first)
    assert got["busy"] == sorted([str(first), str(second)])


def test_worker_omp_env_shortens_the_spin_unless_told() -> None:
    assert cpu_bind.worker_omp_env({}) == {"GOMP_SPINCOUNT": str(cpu_bind.WORKER_SPIN_COUNT)}
    assert cpu_bind.worker_omp_env({"GOMP_SPINCOUNT": "1"}) == {}  # the user's choice
    assert cpu_bind.worker_omp_env({"OMP_WAIT_POLICY": "passive"}) == {}
