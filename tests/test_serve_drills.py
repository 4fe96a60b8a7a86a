"""Fault drills against the kvray Serve app with requests in flight, over real HTTP.

The app serves a tiny random Llama at TP 2 (two worker actors in one placement group), with
n-gram speculative decoding, so the drills take seconds: (a) one TP worker is killed
mid-stream and every request still completes with exactly the tokens it would have had
(the engine replays); (b) the scheduler actor is killed: in-flight requests end with a
clear 503 (an error event on a stream), /health runs a real step and says 503 while no
engine can serve, Serve replaces the engine replica, and new requests succeed once it is
back.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from serve.serve_helpers import running_app

APP = "kvray-drill"
SCHEDULER_PREFIX = f"kvray-scheduler-{APP}-"
MAX_TOKENS = 200
# Token-id prompts inside the tiny model's vocabulary (301 ids).
PROMPTS = [[(7 * i + 13 * j) % 290 + 5 for j in range(6 + i)] for i in range(6)]

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]


@pytest.fixture(scope="module")
def drill_server(ray_session: None, tiny_checkpoints: dict[str, Any]) -> Iterator[str]:
    from kvray.deploy.settings import ServeConfig

    path, _ = tiny_checkpoints["llama"]
    settings = ServeConfig(
        model=str(path),
        tp_size=2,
        num_pages=256,
        dtype="float32",
        served_model_name="tiny",
        app_name=APP,
        health_timeout_s=5.0,
        speculative_tokens=4,  # replays keep the tokens whatever drafts were in flight
    ).resolved()
    with running_app(settings) as url:
        yield url


def live_schedulers() -> list[Any]:
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(SCHEDULER_PREFIX):
            try:
                actor = ray.get_actor(a["name"], namespace=a["namespace"])
                ray.get(actor.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - one that is dead or going away
                continue
            out.append(actor)
    return out


def assert_clean(timeout_s: float = 30.0) -> None:
    (actor,) = live_schedulers()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(actor.stats.remote())
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            ray.get(actor.flush_cache.remote())
            if ray.get(actor.is_idle_and_empty.remote()):
                break
        assert time.monotonic() < deadline, f"engine not idle and empty: {stats}"
        time.sleep(0.1)
    ray.get(actor.check_integrity.remote())


class Stream(threading.Thread):
    """One streamed completion read to its end; `started` is set after a few events."""

    def __init__(self, base: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.base, self.prompt = base, prompt
        self.started = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.status: int | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.Client(base_url=self.base, timeout=300) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if len(self.events) >= 3:
                            self.started.set()
        self.started.set()

    @property
    def text(self) -> str:
        return "".join(c["text"] for e in self.events for c in e.get("choices", ()))


def start_streams(base: str) -> list[Stream]:
    streams = [Stream(base, p) for p in PROMPTS]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120), "a stream produced nothing"
    assert not all(s.done for s in streams), "everything finished before the fault"
    return streams


def test_killing_a_tp_worker_loses_no_request(drill_server: str) -> None:
    with httpx.Client(base_url=drill_server, timeout=300) as c:
        body = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0}
        want = {
            ch["index"]: ch["text"] for ch in c.post("/v1/completions", json=body).json()["choices"]
        }
    (scheduler,) = live_schedulers()
    stats = ray.get(scheduler.stats.remote())
    recoveries = stats["recoveries"]
    assert stats["accepted_draft_tokens"] > 0  # the streams below run with drafts held

    streams = start_streams(drill_server)
    ray.get(scheduler.kill_worker.remote(1))
    for s in streams:
        s.join(180)
        assert s.status == 200 and s.done, "a stream did not complete"
        assert not any("error" in e for e in s.events), s.events[-1]
        assert s.events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert s.events[-2]["choices"][0]["finish_reason"] == "length"
    # the replayed requests produced exactly what they would have without the fault
    assert [s.text for s in streams] == [want[i] for i in range(len(PROMPTS))]
    assert ray.get(scheduler.stats.remote())["recoveries"] == recoveries + 1
    assert_clean()


def test_killing_the_scheduler_fails_in_flight_requests_clearly_then_recovers(
    drill_server: str,
) -> None:
    from kvray.deploy.app import live_placement_groups

    (scheduler,) = live_schedulers()
    assert httpx.get(f"{drill_server}/health", timeout=30).status_code == 200
    groups = live_placement_groups()
    streams = start_streams(drill_server)
    whole: dict[str, Any] = {}

    def one_whole() -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS * 2, "temperature": 0}
        r = httpx.post(f"{drill_server}/v1/completions", json=body, timeout=300)
        whole.update(status=r.status_code, body=r.json())

    waiter = threading.Thread(target=one_whole, daemon=True)
    waiter.start()
    time.sleep(0.3)
    ray.kill(scheduler, no_restart=True)

    # In flight: a clear 503, as an error event on a stream, as the body otherwise.
    for s in streams:
        s.join(120)
        assert s.status == 200 and s.done, "a stream was dropped without an ending"
        last = s.events[-1]
        assert last["error"]["code"] == 503 and last["error"]["type"] == "ServiceUnavailableError"
        assert "engine failed" in last["error"]["message"]
    waiter.join(120)
    assert whole["status"] == 503, whole
    assert whole["body"]["error"]["type"] == "ServiceUnavailableError"

    # /health runs a real step: not 200 while no engine can serve; 200 once one is back.
    health = httpx.get(f"{drill_server}/health", timeout=60)
    assert health.status_code == 503, health.text
    deadline = time.monotonic() + 240
    codes = [health.status_code]
    while codes[-1] != 200:
        assert time.monotonic() < deadline, f"no engine came back: {codes[-5:]}"
        time.sleep(1)
        codes.append(httpx.get(f"{drill_server}/health", timeout=60).status_code)
    assert set(codes) <= {200, 503}, codes

    r = httpx.post(
        f"{drill_server}/v1/completions",
        json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # the dead engine's placement group was released; the new engine holds one
    assert live_placement_groups() == groups
    assert_clean()
