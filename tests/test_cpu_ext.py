"""The CPU kernels' loader: off by switch, and a failed build falls back instead of raising."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from kvray import cpu_ext
from kvray.cpu_ext import CpuExtension


def test_switched_off_never_builds(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "0")
    source = tmp_path / "never_built.cpp"
    source.write_text("this is not C++")
    ext = CpuExtension(source)
    assert ext.load() is None and not ext.available()


def test_every_source_edit_is_a_new_build(monkeypatch, tmp_path) -> None:
    """Builds are named by a hash of the source, the headers beside it, the flags and the
    CPU: an edit never loads a stale binary, and the shipped kernels are real files."""
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 0; }\n")
    name = CpuExtension(source).build_name()
    assert name.startswith("kvray_k_") and name == CpuExtension(source).build_name()
    assert CpuExtension(source, ["-DX"]).build_name() != name
    source.write_text("int f() { return 1; }\n")
    assert CpuExtension(source).build_name() != name
    name = CpuExtension(source).build_name()
    (tmp_path / "shared.h").write_text("#pragma once\n")  # a header it may include
    assert CpuExtension(source).build_name() != name
    name = CpuExtension(source).build_name()
    # Another torch install (another venv) builds its own: neither rebuilds the other's.
    import torch

    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert CpuExtension(source).build_name() != name
    monkeypatch.undo()
    assert CpuExtension(source).build_name() == name
    # Compiled with -march=native: a binary from another CPU is never loaded here.
    monkeypatch.setattr(cpu_ext, "cpu_identity", lambda: "vendor_id=Other\nflags=fpu sse2")
    assert CpuExtension(source).build_name() != name
    shipped = sorted(p.name for p in cpu_ext.CSRC.glob("*.cpp"))
    assert shipped == [
        "amx_linear.cpp",
        "fused_ops.cpp",
        "fused_ops_avx2.cpp",
        "kv_store.cpp",
        "omp_bind.cpp",
        "paged_attention.cpp",
        "paged_attention_avx2.cpp",
    ]


def test_a_failed_build_is_a_warning_and_none(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "1")
    source = tmp_path / "broken_build.cpp"
    source.write_text("int f( { return 0; }")
    ext = CpuExtension(source, requires=())  # tried on any CPU
    with caplog.at_level(logging.WARNING, logger="kvray.cpu_ext"):
        assert ext.load() is None
    assert "broken_build.cpp unavailable" in caplog.text
    caplog.clear()
    assert ext.load() is None and not caplog.text  # tried once, not again


def test_a_cpu_without_the_required_sets_never_builds(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_ext, "_cpuinfo", lambda: "flags\t\t: fpu sse2 avx2 fma\n")
    assert cpu_ext.cpu_flags() == {"fpu", "sse2", "avx2", "fma"}
    source = tmp_path / "never_built.cpp"
    source.write_text("this is not C++")  # a build would fail, with a warning
    with caplog.at_level(logging.WARNING, logger="kvray.cpu_ext"):
        assert CpuExtension(source, requires=("avx2", "avx512f")).load() is None
        # a build for CPUs without a set this one has (a faster build serves here)
        assert CpuExtension(source, requires=("avx2",), excludes=("fma",)).load() is None
    assert not caplog.text


def test_build_all_covers_every_shipped_kernel() -> None:
    """`python -m kvray.cpu_ext` (run before the tests) builds every kernel kvray ships;
    each is then available on a CPU with the instruction sets it requires (the AMX one
    says whether it may run), and none is tried on a CPU without them."""
    built = cpu_ext.build_all()
    assert sorted(built) == sorted(p.name for p in cpu_ext.CSRC.glob("*.cpp"))
    for where in cpu_ext.KERNEL_MODULES:
        ext = cpu_ext.extension(where)
        runs_here = cpu_ext.kernels_enabled() and ext.suits_cpu()
        assert built[ext.source.name] == runs_here, ext.source.name


def test_pending_builds_are_the_kernels_this_cpu_runs_that_the_cache_lacks(
    monkeypatch, tmp_path
) -> None:
    """What `kvray serve` compiles before its workers start: every kernel this CPU runs
    while torch's cache is empty, none once they are built, none when switched off."""
    runs_here = [
        where
        for where in cpu_ext.KERNEL_MODULES
        if cpu_ext.kernels_enabled() and cpu_ext.extension(where).suits_cpu()
    ]
    for where in runs_here:  # built (or loaded, where `make test` built them already)
        cpu_ext.extension(where).load()
    assert cpu_ext.pending_builds() == []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache
    assert cpu_ext.pending_builds() == runs_here
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "0")
    assert cpu_ext.pending_builds() == []


@pytest.mark.skipif(not cpu_ext.kernels_enabled(), reason="kernels switched off")
def test_a_build_lock_left_by_a_dead_build_is_cleared() -> None:
    """torch waits for its build lock on every load, built or not: one that a killed build
    left behind must not hang every later process. A fresh lock (a build running now) is
    left alone. In a child process, so that a regression fails on the timeout instead of
    hanging the suite."""
    code = """
import os, time
from kvray import cpu_ext
from kvray.workers import cpu_bind
ext = cpu_bind._EXTENSION
lock = ext.build_dir() / "lock"
lock.parent.mkdir(parents=True, exist_ok=True)
lock.write_text("")
ext._clear_stale_lock()
assert lock.exists(), "a fresh lock was removed"
old = time.time() - cpu_ext.STALE_LOCK_S - 60
os.utime(lock, (old, old))
assert ext.load() is not None
assert not lock.exists()
"""
    subprocess.run([sys.executable, "-c", code], timeout=300, check=True)
