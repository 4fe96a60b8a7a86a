"""The soak at CI size: `kvray bench soak` in a subprocess (its own Ray cluster and kvray Serve
app, real HTTP): 60 requests from 16 clients, completions and chat, streamed and
not, shared prefixes, a fifth cut at random points, malformed bodies in between. Larger
runs: `kvray bench soak --requests 2000 --concurrency 64`.

Memory: the API side (the ingress replica, the HTTP proxy, the engine replica, the
scheduler actor) must not grow from the first to the last quarter. The TP worker's RSS is
measured and reported but not judged here: it grows with the variety of step shapes it has
run (oneDNN's primitive cache is about half of it; see docs/api.md), which is the worker's
open issue, not a per-request leak of the serving path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQUESTS = 60  # (seeded: 2 malformed bodies, 15 cut)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_ci_size(tmp_path: Path) -> None:
    from kvray.models.embedded import ensure_embedded_model

    ensure_embedded_model(progress=False)
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "kvray.deploy.cli", "bench", "soak"]
    cmd += ["--requests", str(REQUESTS), "--concurrency", "16", "--json", str(out)]
    cmd += ["--rss-roles", "ingress,http_proxy,engine_replica,scheduler"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    summary = {k: v for k, v in report.items() if k != "rss_timeline"}
    assert proc.returncode == 0 and report["failures"] == [], summary

    assert report["completed"] == report["requests"] == REQUESTS
    assert report["errors"] == 0, report["error_samples"]
    # the mix really happened: about a fifth cut, some malformed bodies refused
    assert 0.1 * REQUESTS <= report["disconnects"] <= 0.3 * REQUESTS, summary
    assert report["bad_bodies"] >= 2, summary
    assert report["running"] == 0 and report["waiting"] == 0
    assert report["final_kv_usage"] == report["idle_kv_usage"] == 0.0
    assert report["integrity_ok"] is True and report["pages_leaked"] == 0
    # every process of the app was sampled in both the first and the last quarter
    roles = {"ingress", "engine_replica", "scheduler", "worker", "http_proxy"}
    assert set(report["rss_growth_mb"]) == roles, summary
    for role in roles - {"worker"}:
        assert report["rss_growth_mb"][role] <= 32, summary
