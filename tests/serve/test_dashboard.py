"""The Grafana dashboard (deploy/grafana/kvray-dashboard.json) against the real metrics.

Every `kvray:` metric the dashboard's PromQL queries must be exported, with the right type,
by a LIVE kvray server's /metrics: the package's shared Serve app on the embedded model is
scraped before and after one question, so the histograms move by exactly that request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .serve_helpers import MODEL

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvray-dashboard.json"

METRIC = re.compile(r"kvray:[A-Za-z0-9_:]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# -- the dashboard -----------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and template-variable queries."""
    exprs = [
        t["expr"]
        for p in iter_panels(dashboard["panels"])
        for t in p.get("targets", [])
        if "expr" in t
    ]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    return {m for expr in dashboard_queries(dashboard) for m in METRIC.findall(expr)}


def expected_family(name: str) -> tuple[str, str]:
    """(family name, type) that an exposed sample name belongs to, as prometheus-client
    exposes them: counters as `<family>_total`, histograms as `<family>_bucket/_sum/_count`."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "histogram"
    if name.endswith("_total"):
        return name[: -len("_total")], "counter"
    return name, "gauge"


def test_dashboard_structure():
    d = load_dashboard()
    assert d["title"] and d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    # The data source is a variable, so the dashboard imports into any Grafana.
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert variables["model_name"]["datasource"]["uid"] == "${datasource}"
    assert "model_name" in json.dumps(variables["model_name"]["query"])
    panels = [p for p in iter_panels(d["panels"]) if p["type"] != "row"]
    assert len(panels) >= 10
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in iter_panels(d["panels"])]
    assert len(ids) == len(set(ids))


def test_dashboard_queries_what_the_issue_asks_for():
    exprs = dashboard_queries(load_dashboard())
    joined = "\n".join(exprs)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for p in ("0.5", "0.9", "0.99"):
            assert re.search(
                rf"histogram_quantile\({p}, sum by \(le[^)]*\) \(rate\(kvray:{hist}_bucket", joined
            ), (hist, p)
    for counter in ("prompt_tokens_total", "generation_tokens_total"):
        assert f"rate(kvray:{counter}" in joined
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"kvray:{gauge}" in joined
    assert re.search(
        r"rate\(kvray:prefix_cache_hits_total[^\n]*\)\)\n/\n[^\n]*rate\(kvray:prefix_cache_queries_total",
        joined,
    ), "prefix hit rate = rate(hits) / rate(queries)"
    assert "rate(kvray:num_preemptions_total" in joined
    assert "rate(kvray:num_aborted_requests_total" in joined


def test_dashboard_shows_requests_that_ended_as_abort():
    """Client disconnects count as request_success{finished_reason="abort"} (as in vLLM):
    the abort panel plots that series next to the engines' own count."""
    d = load_dashboard()
    (panel,) = [p for p in iter_panels(d["panels"]) if p.get("title") == "Aborted requests"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert any(
        re.search(r'rate\(kvray:request_success_total\{[^}]*finished_reason="abort"', e)
        for e in exprs
    ), exprs
    assert any("kvray:num_aborted_requests_total" in e for e in exprs), exprs
    (by_reason,) = [
        p for p in iter_panels(d["panels"]) if p.get("title") == "Finished requests by reason"
    ]
    assert "finished_reason" in by_reason["targets"][0]["expr"]


def test_every_selector_filters_on_the_model_variable():
    """Every kvray selector in a panel honours the $model_name variable."""
    d = load_dashboard()
    for panel in iter_panels(d["panels"]):
        for target in panel.get("targets", []):
            for m in re.finditer(r"(kvray:[A-Za-z0-9_:]+)(\{[^}]*\})?", target["expr"]):
                assert m.group(2) and 'model_name=~"$model_name"' in m.group(2), (
                    panel["title"],
                    m.group(0),
                )
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"]


def test_dashboard_promql_parses():
    """Optional: a real PromQL parser (promql-parser) accepts every query and finds the same
    metric names as the regex the live test uses."""
    promql_parser = pytest.importorskip("promql_parser", reason="pip install promql-parser")

    def selectors(node: Any) -> Iterator[str]:
        if type(node).__name__ == "VectorSelector":
            yield node.name
            return
        for attr in ("expr", "lhs", "rhs", "args", "param", "vector_selector"):
            child = getattr(node, attr, None)
            for c in child if isinstance(child, list | tuple) else [child]:
                if c is not None and not isinstance(c, int | float | str):
                    yield from selectors(c)

    for expr in dashboard_queries(load_dashboard()):
        if expr.startswith("label_values("):
            names = set(METRIC.findall(expr))
        else:
            concrete = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
            names = set(selectors(promql_parser.parse(concrete)))
        assert names == set(METRIC.findall(expr)), expr


# -- the live server -----------------------------------------------------------------------------


def _scrape(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {
        s.name: s
        for f in families.values()
        for s in f.samples
        if s.labels.get("model_name") == MODEL
    }
    return {"families": families, "samples": samples}


@pytest.fixture(scope="module")
def live_metrics(http: httpx.Client) -> dict[str, Any]:
    """/metrics after one greedy 4-token completion, and what it moved since before it."""
    before = _scrape(http)["samples"]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    r = http.post("/v1/completions", json=body | {"temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = _scrape(http)

    def moved(name: str) -> float:
        was = before.get(name)
        return after["samples"][name].value - (0.0 if was is None else was.value)

    after["moved"] = moved
    after["usage"] = r.json()["usage"]
    return after


def test_dashboard_metrics_are_exported(live_metrics):
    families, samples = live_metrics["families"], live_metrics["samples"]
    names = dashboard_metric_names(load_dashboard())
    assert len(names) >= 15, names
    missing, wrong_type = [], []
    for name in sorted(names):
        family, kind = expected_family(name)
        if name not in samples or family not in families:
            missing.append(name)
        elif families[family].type != kind:
            wrong_type.append(f"{name}: {family} is a {families[family].type}, not a {kind}")
    exported = sorted(n for n in samples if n.startswith("kvray:"))
    assert not missing, (
        f"queried by the dashboard but not exported: {missing}\nexported: {exported}"
    )
    assert not wrong_type, wrong_type
    # Every queried family carries the model_name label the dashboard filters on.
    for name in names:
        family = families[expected_family(name)[0]]
        assert any(s.labels.get("model_name") == MODEL for s in family.samples), name


def test_histograms_hold_the_request(live_metrics):
    moved = live_metrics["moved"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"kvray:{hist}_count") == 1, hist
    assert moved("kvray:inter_token_latency_seconds_count") == 3  # 4 tokens, 3 gaps
    assert moved("kvray:generation_tokens_total") == 4
    assert moved("kvray:prompt_tokens_total") == live_metrics["usage"]["prompt_tokens"]
    # The engine's steps: one for the prompt (it fits a chunk), one per later token, each
    # with its tokens and the time it took (nothing else runs on the engine meanwhile).
    steps = moved("kvray:iteration_tokens_total_count")
    assert steps == 4
    assert moved("kvray:step_compute_seconds_count") == steps
    assert moved("kvray:step_compute_seconds_sum") > 0
    computed = moved("kvray:prefill_computed_tokens_total")
    assert moved("kvray:iteration_tokens_total_sum") == computed + 3
