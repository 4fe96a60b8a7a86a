"""/health under load, and vLLM's utility endpoints (/tokenize, /detokenize, /version).

Against the package's shared Serve app (real HTTP), plus the health rule's parts on their
own (the step loop's progress clock, the rule over the engines' stats) and the API-key
rule on an in-process app.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import ray
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

import kvray
from kvray.cluster.scheduler_actor import StepThread
from kvray.deploy.api import create_app
from kvray.deploy.generation import EngineLimits
from kvray.deploy.openai import OpenAIServing

from .serve_helpers import (
    CONTEXT,
    FRANCE,
    LONG_STREAM,
    MODEL,
    assert_engine_clean,
    chat_ids,
    scheduler,
)

pytestmark = [
    pytest.mark.timeout(300),
    # Ray Serve's own config models still use pydantic v1-style Field extras.
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]

VOCAB = 49152  # the embedded SmolLM2's


@pytest.fixture
def clean_engine(server: str) -> Iterator[None]:
    yield
    assert_engine_clean()


def assert_400(r: httpx.Response, param: str | None, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])


# -- /health under load -------------------------------------------------------------------------


def test_health_answers_at_once_while_the_engine_is_saturated(
    http: httpx.Client, server: str, clean_engine: None
) -> None:
    """Many long streams keep the engine busy with requests waiting for pages: /health
    answers 200 at once, from the engine's progress, and sends it no probe (a probe would
    queue behind the streams, and count as a finished request)."""
    streams = 12
    body = LONG_STREAM
    clients = [httpx.Client(base_url=server, timeout=120) for _ in range(streams)]
    responses = []
    try:
        for c in clients:
            r = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
            assert r.status_code == 200
            responses.append(r)
        readers = [r.iter_lines() for r in responses]  # kept: a collected one closes
        for lines in readers:
            while not next(lines).startswith("data: "):
                pass
        # Saturated: the KV pool holds less than the streams need, so some wait.
        actor = scheduler()
        deadline = time.monotonic() + 120
        while True:
            before = ray.get(actor.stats.remote())
            if before["num_waiting"] > 0:
                break
            assert time.monotonic() < deadline, f"never saturated: {before}"
            time.sleep(0.2)
        assert before["has_work"] and before["num_running"] + before["num_waiting"] == streams

        for _ in range(3):
            start = time.monotonic()
            r = http.get("/health")
            took = time.monotonic() - start
            assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
            assert took < 2.0, f"/health took {took:.2f}s under load"

        after = ray.get(actor.stats.remote())
        # No probe went through the engine: nothing finished or was aborted meanwhile, and
        # the same requests are there (the streams are far from their max_tokens).
        for key in ("num_finished", "num_aborted"):
            assert after[key] == before[key], (key, before, after)
        assert after["num_running"] + after["num_waiting"] == streams, after
        while after["steps"] == before["steps"]:  # and the engine kept stepping
            assert time.monotonic() < deadline, f"the engine stopped stepping: {after}"
            time.sleep(0.1)
            after = ray.get(actor.stats.remote())
    finally:
        for r in responses:
            r.close()
        for c in clients:
            c.close()


def test_health_probes_an_idle_engine(http: httpx.Client, clean_engine: None) -> None:
    """Idle, progress proves nothing: the one-token probe runs (and finishes)."""
    before = ray.get(scheduler().stats.remote())
    assert not before["has_work"]
    assert http.get("/health").status_code == 200
    after = ray.get(scheduler().stats.remote())
    assert after["num_finished"] == before["num_finished"] + 1


def test_the_health_rule_over_engine_stats() -> None:
    from kvray.deploy.app import engines_progressing  # (Serve warns as it loads)

    busy = {"has_work": True, "progress_age_s": 0.5}
    idle = {"has_work": False, "progress_age_s": 60.0}
    assert engines_progressing([busy], 10.0)
    assert engines_progressing([busy, {**busy, "progress_age_s": 9.9}], 10.0)
    # one loaded replica beside idle ones: the app progresses (a probe could queue behind it)
    assert engines_progressing([idle, busy, idle], 10.0)
    # all idle (the probe is cheap there), one stuck, unknown, or no engine: the probe decides
    assert not engines_progressing([idle], 10.0)
    assert not engines_progressing([idle, idle], 10.0)
    assert not engines_progressing([{**busy, "progress_age_s": 10.5}], 10.0)
    assert not engines_progressing([busy, {**busy, "progress_age_s": 30.0}], 10.0)
    assert not engines_progressing([busy, {"num_running": 3}], 10.0)
    assert not engines_progressing([{"num_running": 3}], 10.0)
    assert not engines_progressing([], 10.0)


def test_an_app_finds_its_own_engines_only() -> None:
    from kvray.deploy.app import is_app_scheduler
    from kvray.deploy.router import scheduler_name

    assert is_app_scheduler(scheduler_name("kvray", "a1b2c3d4"), "kvray")
    assert not is_app_scheduler(scheduler_name("kvray-b", "a1b2c3d4"), "kvray")
    assert is_app_scheduler(scheduler_name("kvray-b", "a1b2c3d4"), "kvray-b")
    assert not is_app_scheduler(scheduler_name("kvray", ""), "kvray")


class _Core:
    """Enough of an EngineCore for a StepThread: `mode` says what a step does."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(stats=SimpleNamespace(steps=0))
        self.mode = "step"  # step | hang | spin (has work, but plans and settles nothing)
        self.release = threading.Event()

    @property
    def has_work(self) -> bool:
        return self.mode != "idle"

    def step(self, before_wait: Any = None) -> list[Any]:
        if self.mode == "hang":
            self.release.wait()
            return []
        if self.mode == "step":
            self.scheduler.stats.steps += 1
        time.sleep(0.005)
        return []


def test_step_loop_progress_stops_when_a_step_hangs() -> None:
    from kvray.deploy.app import engines_progressing

    core = _Core()
    loop = asyncio.new_event_loop()
    steps = StepThread(core, loop, lambda events: None)  # type: ignore[arg-type]
    try:
        time.sleep(0.1)
        assert steps.progress_age_s() < 0.2  # stepping
        core.mode = "hang"  # a worker that never answers
        time.sleep(0.3)
        assert steps.progress_age_s() >= 0.25
        stuck = {"has_work": True, "progress_age_s": steps.progress_age_s()}
        assert not engines_progressing([stuck], 0.2)
        core.mode = "spin"
        core.release.set()
        time.sleep(0.3)  # returns from steps, but none planned or settled: no progress
        assert steps.progress_age_s() >= 0.25
        core.mode = "idle"
        time.sleep(0.05)
        assert steps.progress_age_s() < 0.3  # idle: nothing to be stuck on
    finally:
        core.release.set()
        steps.stop()
        loop.close()


# -- /tokenize, /detokenize, /version -------------------------------------------------------------

TEXT = "Hello, world! héllo 😀 — the café's <b>menu</b>"


def test_tokenize_then_detokenize_round_trips(http: httpx.Client, tokenizer: Any) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tokenizer(TEXT)["input_ids"]
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == CONTEXT
    assert got["token_strs"] is None
    r = http.post("/detokenize", json={"model": MODEL, "tokens": got["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    # model is optional; add_special_tokens and return_token_strs as in vLLM
    r = http.post(
        "/tokenize", json={"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    plain = r.json()
    assert plain["tokens"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    r = http.post("/tokenize", json={"prompt": ""})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"])


def test_tokenize_a_chat_as_chat_completions_prompts_it(http: httpx.Client, tokenizer: Any) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "messages": FRANCE})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == chat_ids(tokenizer, FRANCE)
    chat = {"model": MODEL, "messages": FRANCE, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == got["count"]
    text = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": text}

    # The template options and tools count as they do for chat completions.
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    cont = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    options: list[dict[str, Any]] = [
        {"messages": cont, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": FRANCE, "tools": [weather]},
        {"messages": FRANCE, "add_generation_prompt": False},
    ]
    counts = set()
    for extra in options:
        r = http.post("/tokenize", json=extra)
        assert r.status_code == 200, (extra, r.text)
        r2 = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r2.status_code == 200, (extra, r2.text)
        assert r2.json()["usage"]["prompt_tokens"] == r.json()["count"], extra
        counts.add(r.json()["count"])
    assert len(counts) == len(options)  # each option changed the prompt


def test_version(http: httpx.Client) -> None:
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": kvray.__version__}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/tokenize", {}, "prompt", ("prompt", "messages", "required")),
        ("/tokenize", {"prompt": "hi", "messages": FRANCE}, "messages", ("not both",)),
        ("/tokenize", {"prompt": 5}, "prompt", ("must be a string",)),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", ()),
        ("/tokenize", {"messages": []}, "messages", ("at least 1",)),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages", ("needs content",)),
        (
            "/tokenize",
            {"messages": FRANCE, "continue_final_message": True},
            "continue_final_message",
            ("add_generation_prompt: false",),
        ),
        ("/tokenize", {"messages": FRANCE, "add_special_tokens": True}, "add_special_tokens", ()),
        (
            "/tokenize",
            {"messages": FRANCE, "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            ("'tools'",),
        ),
        ("/detokenize", {}, "tokens", ("required",)),
        ("/detokenize", {"tokens": "hi"}, "tokens", ("must be an array",)),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens", ("tokens[1]", "integer")),
        ("/detokenize", {"tokens": [1, VOCAB]}, "tokens", ("tokens[1]", "vocabulary")),
        ("/detokenize", {"tokens": [-1]}, "tokens", ("tokens[0]", "vocabulary")),
        ("/detokenize", {"tokens": [True]}, "tokens", ("integer",)),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    assert_400(http.post(path, json=body), param, *words)


def test_more_refusals(http: httpx.Client) -> None:
    huge = b'{"tokens": [1, 1' + b"0" * 5000 + b"]}"
    r = http.post("/detokenize", content=huge, headers={"content-type": "application/json"})
    assert_400(r, "tokens", "digits")
    r = http.post("/tokenize", content=b"[1]", headers={"content-type": "application/json"})
    assert_400(r, None, "JSON object")
    for path, body in (
        ("/tokenize", {"model": "other", "prompt": "hi"}),
        ("/tokenize", {"model": "other", "messages": FRANCE}),
        ("/detokenize", {"model": "other", "tokens": [1]}),
    ):
        r = http.post(path, json=body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["param"] == "model", err
    r = http.get("/tokenize")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert http.post("/version").status_code == 405


# -- the API key ----------------------------------------------------------------------------------


class _NoEngine:
    async def generate(self, input_ids: list[int], sampling: Any) -> Any:
        raise AssertionError("these endpoints never reach an engine")


def test_utility_endpoints_are_behind_the_api_key(tokenizer: Any) -> None:
    serving = OpenAIServing(MODEL, tokenizer, EngineLimits(CONTEXT, VOCAB), _NoEngine())
    app = create_app(serving, CollectorRegistry(), api_key="sesame")
    with TestClient(app) as c:
        calls = [
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/version", None),
        ]
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
            assert r.status_code == 200, (path, r.text)
        doc = c.get("/openapi.json", headers={"Authorization": "Bearer sesame"}).json()
    for path, method in (("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get")):
        op = doc["paths"][path][method]
        assert "401" in op["responses"] and "security" not in op, path
