"""Helpers shared by the Serve tests: the app under test, the engine's page accounting, the
metrics, SSE parsing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families

from kvray.net import free_port

MODEL = "SmolLM2-135M-Instruct"
APP = "kvray"
SCHEDULER_PREFIX = f"kvray-scheduler-{APP}-"
PAGE_SIZE = 16
NUM_PAGES = 64
CONTEXT = NUM_PAGES * PAGE_SIZE  # 1024 < the model's 8192: the KV pool bounds a sequence
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# The shared server's operator limits (`kvray serve --max-tokens-default/--max-tokens-cap`).
MAX_TOKENS_DEFAULT = 48
MAX_TOKENS_CAP = 1000


# A stream that runs to the KV pool's end: sampled (no two alike), no EOS.
LONG_STREAM = {
    "model": MODEL,
    "prompt": "Tell me a very long story about a dragon.",
    "max_tokens": CONTEXT - 64,
    "ignore_eos": True,
    "temperature": 0.8,
    "stream": True,
}


@contextmanager
def serve_app(model_dir: Path, **settings: Any) -> Iterator[str]:
    """Run the kvray Serve app (`settings`: ServeConfig fields); yields its root URL.
    Deletes it and stops Serve after."""
    from kvray.deploy.settings import ServeConfig

    resolved = ServeConfig(
        model=str(model_dir),
        num_pages=NUM_PAGES,
        page_size=PAGE_SIZE,
        dtype="float32",
        served_model_name=MODEL,
        app_name=APP,
        **settings,
    ).resolved()
    with running_app(resolved) as url:
        yield url


@contextmanager
def running_app(settings: Any) -> Iterator[str]:
    """Serve the app of resolved `settings` (a ServeConfig) over HTTP on a free port of
    127.0.0.1; yields its root URL. Deletes it and stops Serve after."""
    from ray import serve

    from kvray.deploy.app import start_app

    port = free_port()
    serve.shutdown()  # a Serve left by an earlier module would keep its own HTTP port
    start_app(settings, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.delete(settings.app_name)
        finally:
            serve.shutdown()


# -- helpers ----------------------------------------------------------------------------------


def scheduler() -> Any:
    """The one live scheduler actor of the app."""
    live = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if not a["name"].startswith(SCHEDULER_PREFIX):
            continue
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            ray.get(actor.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - one left over from an app being deleted
            continue
        live.append(actor)
    assert len(live) == 1, f"expected one live engine, found {len(live)}"
    return live[0]


def assert_engine_clean(timeout_s: float = 30.0) -> dict[str, Any]:
    """No request left on the engine, page accounting balances, and once the prefix cache
    is flushed every page is free. Returns the final stats."""
    actor = scheduler()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(actor.stats.remote())
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            ray.get(actor.flush_cache.remote())
            if ray.get(actor.is_idle_and_empty.remote()):
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle and empty after {timeout_s}s: {stats}")
        time.sleep(0.1)
    ray.get(actor.check_integrity.remote())
    return ray.get(actor.stats.remote())


def metrics(http: httpx.Client) -> dict[str, Any]:
    """/metrics parsed: {family name: family}."""
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    """The value of `name + suffix` whose labels include `labels` (model_name implied)."""
    want = {"model_name": MODEL, **labels}
    hits = [
        s.value
        for s in families[name].samples
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in want.items())
    ]
    assert len(hits) == 1, f"{name}{suffix} {want}: {hits}"
    return hits[0]


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    """Every `data:` event of a finished SSE response; the stream must end with [DONE]."""
    events, done = [], False
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    assert done, "the stream did not end with data: [DONE]"
    return events


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
