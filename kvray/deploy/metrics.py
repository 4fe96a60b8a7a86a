"""Prometheus metrics, named like vLLM's (prefix `kvray:`, label `model_name`) so existing
dashboards carry over.

Request-level histograms and token counters are observed by the API server as requests
stream through it, counted as vLLM counts them: a request's prompt tokens once its first
token is out (its prefill ran), each generated token as it arrives, and every request that
ends, by its reason, `abort` included (a client that went away, an engine that failed), so
aborted work shows on the dashboard like any other.

Engine-level gauges and counters (running / waiting requests, KV usage, the prefill
budget, prefix-cache queries and hits, preemptions, aborts) are read from every engine's
scheduler at scrape time by `EngineCollector`, so they are exact and summed over
data-parallel engines (the two per-engine levels, KV usage and the prefill budget, are
averaged).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvray import histogram

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class RequestMetrics:
    """The metrics the API server observes itself."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        label = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            h = Histogram(f"kvray:{name}", doc, label, registry=registry, buckets=buckets)
            return h.labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency.", _LATENCY_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS
        )
        self.prompt_len = hist(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.gen_len = hist(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter(
            "kvray:prompt_tokens", "Prompt tokens processed.", label, registry=registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "kvray:generation_tokens", "Tokens generated.", label, registry=registry
        ).labels(model_name)
        self.constrained_requests = Counter(
            "kvray:constrained_requests",
            "Requests whose output a grammar constrains (structured outputs, forced tools).",
            label,
            registry=registry,
        ).labels(model_name)
        self.grammar_compile = hist(
            "grammar_compile_seconds",
            "Time to compile a grammar this server had not compiled before.",
            _COMPILE_BUCKETS,
        )
        self._success = Counter(
            "kvray:request_success",
            "Requests finished, by reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # export zeros from the start

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def track(self, prompt_len: int) -> RequestTracker:
        return RequestTracker(self, prompt_len)


class RequestTracker:
    """One engine request's observations; `finish` records it once, whatever the reason."""

    def __init__(self, metrics: RequestMetrics, prompt_len: int) -> None:
        self.m = metrics
        self.prompt_len = prompt_len
        self.start = self.last = time.monotonic()
        self.generated = 0
        self.finished = False

    def token(self) -> None:
        now = time.monotonic()
        if self.generated == 0:
            self.m.ttft.observe(now - self.last)
            self.m.prompt_tokens.inc(self.prompt_len)
        else:
            self.m.itl.observe(now - self.last)
        self.m.generation_tokens.inc()
        self.last = now
        self.generated += 1

    def finish(self, reason: str, queue_time_s: float | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.m.e2e.observe(time.monotonic() - self.start)
        self.m.prompt_len.observe(self.prompt_len)
        self.m.gen_len.observe(self.generated)
        if queue_time_s is not None:
            self.m.queue.observe(queue_time_s)
        self.m.success(reason)


class EngineCollector(Collector):
    """Gauges and counters read from the engines' schedulers on every scrape."""

    def __init__(self, model_name: str, read_stats: Callable[[], list[dict[str, Any]]]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        from kvray.cluster.kv_transfer import FETCH_BUCKETS_S
        from kvray.scheduler.scheduler import STEP_SECONDS_BUCKETS, STEP_TOKEN_BUCKETS

        stats = self.read_stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        total = lambda key: float(sum(s.get(key, 0) for s in stats))  # noqa: E731
        yield gauge(
            "num_requests_running", "Requests running on the engines.", total("num_running")
        )
        yield gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", total("num_waiting")
        )
        usage = total("kv_cache_usage") / len(stats) if stats else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0-1).", usage)
        budget = total("prefill_budget_tokens") / len(stats) if stats else 0.0
        yield gauge(
            "prefill_budget_tokens",
            "Prompt tokens the next step may compute beside the running decodes (the "
            "inter-token-latency target's budget; max_prefill_tokens when it is off), "
            "averaged over engines.",
            budget,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            total("prefix_query_tokens"),
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            total("prefix_hit_tokens"),
        )
        yield counter(
            "num_preemptions", "Requests retracted for lack of KV pages.", total("num_preemptions")
        )
        yield counter("num_aborted_requests", "Requests aborted.", total("num_aborted"))
        yield counter(
            "prefill_computed_tokens",
            "Prompt tokens whose K/V the engines computed (not found in a prefix cache, not "
            "fetched from another replica).",
            total("prefill_tokens"),
        )
        # n-gram speculative decoding (--speculative-tokens), as vLLM names them.
        yield counter(
            "spec_decode_num_draft_tokens",
            "Draft tokens checked (speculative decoding).",
            total("draft_tokens"),
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens that held: each one a decode step saved for its request.",
            total("accepted_draft_tokens"),
        )
        # Prefixes shared between replicas (--share-kv: kvray.cluster.kv_transfer).
        yield counter(
            "kv_fetches",
            "Prompt prefixes whose K/V was fetched from another replica.",
            total("kv_fetches"),
        )
        yield counter(
            "kv_fetch_failures",
            "Prefix fetches that failed or found nothing (the request computed instead).",
            total("kv_fetch_failures"),
        )
        yield counter(
            "kv_fetched_tokens",
            "Prompt tokens whose K/V was fetched from another replica instead of computed.",
            total("kv_fetched_tokens"),
        )
        yield counter("kv_exports", "Prefixes copied out to another replica.", total("kv_exports"))
        yield _histogram(
            "kv_fetch_seconds",
            "Time to fetch a prompt prefix's K/V from another replica.",
            labels,
            stats,
            "kv_fetch_seconds",
            FETCH_BUCKETS_S,
        )
        yield _histogram(
            "iteration_tokens_total",
            "Tokens computed per engine step: decodes, draft tokens checked, prompt tokens.",
            labels,
            stats,
            "step_tokens",
            STEP_TOKEN_BUCKETS,
        )
        yield _histogram(
            "step_compute_seconds",
            "Time the workers took to compute an engine step (every running request waits "
            "for its step: the floor of the inter-token latency).",
            labels,
            stats,
            "step_compute_seconds",
            STEP_SECONDS_BUCKETS,
        )


def _histogram(
    name: str,
    doc: str,
    labels: list[str],
    stats: list[dict[str, Any]],
    key: str,
    bounds: Sequence[float],
) -> Metric:
    """A histogram the engines keep in their stats (`kvray.histogram`: `{key}_buckets`,
    `{key}_sum`), summed over engines."""
    counts = histogram.empty_buckets(bounds)
    for s in stats:
        for i, n in enumerate(s.get(f"{key}_buckets", ())):
            counts[i] += n
    h = HistogramMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
    edges = [str(float(b)) for b in bounds] + ["+Inf"]
    total = float(sum(s.get(f"{key}_sum", 0.0) for s in stats))
    h.add_metric(labels, list(zip(edges, counts, strict=True)), total)
    return h


# The prefix router's decisions in this process (kvray.deploy.router): "prefix" (the
# longest match won), "load" (a match lost to the load margin), "no_match" (no replica held
# any page); and the prompt tokens routed ("tokens"), of which the chosen replicas were
# known to hold "matched_tokens".
ROUTER_STATS: collections.Counter[str] = collections.Counter()
# Each engine replica's requests running or waiting, as the prefix router in this process
# last heard from its engine (replica id -> count); a replica leaves when the router stops
# following it.
ROUTER_ENGINE_LOADS: dict[str, int] = {}


class RouterCollector(Collector):
    """The prefix router's decisions in this process (`ROUTER_STATS`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = ROUTER_STATS
        labels = [self.model_name]
        decisions = CounterMetricFamily(
            "kvray:router_decisions",
            "Requests routed by the prefix router, by what decided: prefix (the replica "
            "holding the longest prefix), load (it was too loaded: the least loaded one), "
            "no_match (no replica held any of it: the least loaded one).",
            labels=["model_name", "decision"],
        )
        for decision in ("prefix", "load", "no_match"):
            decisions.add_metric([*labels, decision], float(stats.get(decision, 0)))
        yield decisions
        for name, key, doc in (
            (
                "router_kv_source_hints",
                "kv_source_hints",
                "Requests sent to a replica with another one named to fetch their prefix from.",
            ),
            ("router_prompt_tokens", "tokens", "Prompt tokens of the requests routed."),
            (
                "router_matched_tokens",
                "matched_tokens",
                "Prompt tokens the chosen replica's prefix cache held when it was chosen.",
            ),
        ):
            c = CounterMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
            c.add_metric(labels, float(stats.get(key, 0)))
            yield c
        loads = GaugeMetricFamily(
            "kvray:router_engine_load",
            "Requests running or waiting at each engine replica, as the prefix router last "
            "heard from its engine (what the load margin compares).",
            labels=["model_name", "replica"],
        )
        for replica, load in sorted(ROUTER_ENGINE_LOADS.items()):
            loads.add_metric([*labels, replica], float(load))
        yield loads
