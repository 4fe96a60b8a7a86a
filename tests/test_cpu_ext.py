"""The CPU kernels' loader: off by switch, and a failed build falls back instead of raising."""

from __future__ import annotations

import logging

import pytest

from kvray import cpu_ext
from kvray.cpu_ext import CpuExtension


def test_switched_off_never_builds(monkeypatch) -> None:
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "0")
    ext = CpuExtension("kvray_test_never_built", "this is not C++", ["f"])
    assert ext.load() is None and not ext.available()


@pytest.mark.skipif(not cpu_ext.cpu_has_avx512(), reason="no AVX-512: nothing is ever built")
def test_a_failed_build_is_a_warning_and_none(monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "1")
    ext = CpuExtension("kvray_test_broken_build", "int f( { return 0; }", ["f"])
    with caplog.at_level(logging.WARNING, logger="kvray.cpu_ext"):
        assert ext.load() is None
    assert "kvray_test_broken_build unavailable" in caplog.text
    caplog.clear()
    assert ext.load() is None and not caplog.text  # tried once, not again
