"""`kvray bench overhead` against the shared server: both paths run the same requests, the
served stream carries one token per chunk, and the added latency is the difference."""

from __future__ import annotations

import pytest

from kvray.bench import overhead

from .serve_helpers import assert_engine_clean


def test_overhead_bench_compares_in_process_with_served(server: str) -> None:
    out = overhead.main(
        ["--url", f"{server}/v1", "--requests", "2", "--prompt-len", "8", "--output-len", "5"]
    )
    s = out["summary"]
    for key in ("inprocess_ttft_p50_ms", "served_ttft_p50_ms", "served_itl_p50_ms"):
        assert s[key] > 0, key
    assert s["added_ttft_p50_ms"] == pytest.approx(
        s["served_ttft_p50_ms"] - s["inprocess_ttft_p50_ms"]
    )
    assert s["added_itl_p50_ms"] == pytest.approx(
        s["served_itl_p50_ms"] - s["inprocess_itl_p50_ms"]
    )
    assert_engine_clean()
