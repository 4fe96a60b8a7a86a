"""`python -m kvray.bench.dispatch` runs end to end (a few steps only) and reports the
three executors: Ray Compiled Graph, plain Ray actor calls and in-process."""

from __future__ import annotations

import json

import pytest

from kvray.bench.dispatch import LABELS, main


@pytest.mark.slow  # a Ray cluster (unless one is up) and two TP 2 worker groups: ~20-40 s
def test_dispatch_bench_runs(tmp_path, capsys) -> None:
    out = tmp_path / "dispatch.json"
    report = main(["--tp", "2", "--steps", "5", "--warmup", "5", "--json", str(out)])
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith(tuple(LABELS.values()))]
    assert [r.split("  ")[0] for r in rows] == list(LABELS.values()), text
    saved = json.loads(out.read_text())
    assert saved["summary"] == report["summary"]
    summary = saved["summary"]
    assert summary["tp"] == 2 and summary["running"] == 8
    for name in LABELS:
        assert summary[f"{name}_empty_p50_us"] > 0
        assert summary[f"{name}_decode_p50_us"] > 0
    assert [r["executor"] for r in saved["results"]] == list(LABELS)
    assert [r["tp"] for r in saved["results"]] == [2, 2, 1]
    assert all(r["steps"] == 5 for r in saved["results"])
    # A decode plan of 8 requests carries their rows, not their contexts: a few hundred bytes.
    assert summary["empty_plan_bytes"] < summary["decode_plan_bytes"] < 2048
