"""`scripts/gpu_check.sh --dry-run`: the one-call device check, end to end on this CPU (the
GPU tests on the Triton interpreter, the bench on a tiny random model), so that the
script a GPU session runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]

    suite = ET.parse(tmp_path / "gpu_tests.xml").getroot().find("testsuite")
    assert suite is not None
    ran = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    assert ran == 2 and suite.get("failures") == "0" and suite.get("errors") == "0", log

    summary = json.loads((tmp_path / "bench_offline.json").read_text())["summary"]
    assert summary["kvray_output_tok_s"] > 0 and summary["baseline_output_tok_s"] > 0
    assert summary["decode_mfu"] > 0 and summary["device"] == "cpu"
    assert (tmp_path / "bench_offline.png").stat().st_size > 0
    assert "tests exit 0, bench exit 0" in log and "output tok/s, HF" in log
