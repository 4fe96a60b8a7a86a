"""Prefix-aware routing across engine replicas, over real HTTP through Ray Serve: two
replicas of a tiny random Llama (TP 1, float32), `--router prefix`.

- each follow-up turn of a conversation (the whole history resent) goes to the replica that
  served the turn before, which finds that history in its prefix cache; conversations
  spread over both replicas; every output equals Hugging Face's greedy tokens;
- with that replica loaded past the margin, the follow-up goes to the other one (a "load"
  decision), which fetches the history's K/V from the loaded one (--share-kv) instead of
  computing it, with the same tokens; an export's page locks never outlive its call, and a
  fetch that cannot happen leaves the request to compute;
- with one replica killed mid-run, requests keep being served by the other one: none that
  had not started on the dead replica is lost, and the app serves again once Serve has
  replaced it.
Page accounting balances on every live engine after each test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from engine_checks import hf_greedy
from serve.serve_helpers import running_app

from kvray.core import SamplingParams

APP = "kvray-route"
SCHEDULER_PREFIX = f"kvray-scheduler-{APP}-"
PAGE = 16
MARGIN = 1
TURN_TOKENS = 8  # generated per turn
CONVERSATIONS = 3  # odd: round-robin would move every conversation at its next turn
TURNS = 3
STREAM_TOKENS = 440  # (of the 512 the engine holds) still running when all four have started

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]


@pytest.fixture(scope="module")
def hf(tiny_checkpoints: dict[str, Any]) -> Any:
    return tiny_checkpoints["llama"][1]


@pytest.fixture(scope="module")
def tokenizer_for_tiny(tiny_checkpoints: dict[str, Any]) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoints["llama"][0])


@pytest.fixture(scope="module")
def server(ray_session: None, tiny_checkpoints: dict[str, Any]) -> Iterator[str]:
    from kvray.deploy.settings import ServeConfig

    path, _ = tiny_checkpoints["llama"]
    settings = ServeConfig(
        model=str(path),
        replicas=2,
        num_pages=128,
        page_size=PAGE,
        dtype="float32",
        served_model_name="tiny",
        app_name=APP,
        router_load_margin=MARGIN,
        share_kv=True,
        share_kv_min_tokens=2 * PAGE,
        health_timeout_s=5.0,
    ).resolved()
    assert settings.routing == "prefix"  # the default with more than one replica
    with running_app(settings) as url:
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c
    assert_clean()


def schedulers() -> dict[str, Any]:
    """The app's live scheduler actors, by name."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(SCHEDULER_PREFIX):
            try:
                actor = ray.get_actor(a["name"], namespace=a["namespace"])
                ray.get(actor.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - dead or going away
                continue
            out[a["name"]] = actor
    return out


def stats() -> dict[str, dict[str, Any]]:
    return {name: ray.get(a.stats.remote()) for name, a in schedulers().items()}


def assert_clean(timeout_s: float = 60.0) -> None:
    """Every live engine: no request left, page accounting balances, all pages free once
    the prefix cache is flushed."""
    for name, actor in schedulers().items():
        deadline = time.monotonic() + timeout_s
        while True:
            s = ray.get(actor.stats.remote())
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                ray.get(actor.check_integrity.remote())
                ray.get(actor.flush_cache.remote())
                if ray.get(actor.is_idle_and_empty.remote()):
                    break
            assert time.monotonic() < deadline, f"{name} not idle and empty: {s}"
            time.sleep(0.1)


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = TURN_TOKENS) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def looked_up(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """The engines whose prefix-cache lookups moved between two `stats()` (each admitted
    request looks its prompt up)."""
    return [n for n in after if after[n]["prefix_query_tokens"] != before[n]["prefix_query_tokens"]]


def served_by(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> str:
    """The one engine whose prefix-cache lookups moved between two `stats()`."""
    moved = looked_up(before, after)
    assert len(moved) == 1, f"expected one engine to serve the request, got {moved}"
    return moved[0]


def samples(http: httpx.Client) -> dict[str, float]:
    """The app's /metrics: sample name (with its decision label, if any) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            decision = sample.labels.get("decision")
            out[f"{sample.name}[{decision}]" if decision else sample.name] = sample.value
    return out


def router_decisions(http: httpx.Client) -> dict[str, float]:
    prefix = "kvray:router_decisions_total["
    return {k[len(prefix) : -1]: v for k, v in samples(http).items() if k.startswith(prefix)}


def router_loads(http: httpx.Client) -> dict[str, float]:
    """The router's view of each replica's engine load, by replica id."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for sample in family.samples
        if sample.name == "kvray:router_engine_load"
    }


def wait_for_router_load(http: httpx.Client, scheduler: str, at_least: int) -> None:
    """Until the router has heard that `scheduler`'s engine holds `at_least` requests."""
    deadline = time.monotonic() + 30
    while True:
        loads = router_loads(http)
        seen = [v for replica, v in loads.items() if scheduler.endswith(f"-{replica}")]
        if seen and seen[0] >= at_least:
            return
        assert time.monotonic() < deadline, (scheduler, loads)
        time.sleep(0.05)


def hf_text(tokenizer: Any, prompt: list[int], ids: list[int]) -> str:
    """The text the server shows for output tokens `ids` after `prompt` (its detokenizer)."""
    from kvray.text.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def opening(c: int) -> list[int]:
    """Conversation c's first prompt: 40 to 70 token ids of the tiny vocabulary."""
    return [(11 * c + 7 * j + j * j) % 280 + 10 for j in range(40 + 10 * c)]


def test_follow_up_turns_go_to_the_replica_holding_the_conversation(
    http: httpx.Client, hf: Any, tokenizer_for_tiny: Any
) -> None:
    history = {c: opening(c) for c in range(CONVERSATIONS)}
    home: dict[int, str] = {}
    decisions0 = router_decisions(http)
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):  # interleaved, as independent clients
            prompt = history[c]
            before = stats()
            text = complete(http, prompt)
            after = stats()
            want = hf_greedy(hf, prompt, TURN_TOKENS)
            assert text == hf_text(tokenizer_for_tiny, prompt, want), f"conversation {c}, {turn}"
            engine = served_by(before, after)
            if turn:
                assert engine == home[c], f"conversation {c} turn {turn} moved"
                hit = after[engine]["prefix_hit_tokens"] - before[engine]["prefix_hit_tokens"]
                held = (len(prompt) - TURN_TOKENS - 6) // PAGE * PAGE  # last turn's prompt
                assert hit >= held, f"conversation {c} turn {turn}: {hit} of {held} cached"
            home[c] = engine
            # the next turn: the whole history, this turn's reply and a new user message
            history[c] = prompt + want + [(5 * turn + c + j) % 280 + 10 for j in range(6)]
            time.sleep(0.05)  # a client's pause: the reply's prefix reaches the router
    assert len(set(home.values())) == 2, "all conversations on one replica"
    decisions = router_decisions(http)
    follow_ups = CONVERSATIONS * (TURNS - 1)
    assert decisions.get("prefix", 0) - decisions0.get("prefix", 0) >= follow_ups


def test_a_loaded_replica_loses_the_follow_up(
    http: httpx.Client, hf: Any, tokenizer_for_tiny: Any
) -> None:
    prompt = opening(7)
    before = stats()
    complete(http, prompt)
    home = served_by(before, stats())
    # Load the conversation's replica past the margin, behind the router's back.
    actor = schedulers()[home]
    busy = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    rids = [ray.get(actor.submit.remote(opening(20 + i)[:30], busy)) for i in range(MARGIN + 2)]
    try:
        # The engine's load reaches the router with its next step: wait until it has.
        wait_for_router_load(http, home, len(rids))
        decisions0 = router_decisions(http)
        follow_up = prompt + hf_greedy(hf, prompt, TURN_TOKENS) + [42] * 6
        before = stats()
        text = complete(http, follow_up)
        after = stats()
        other = served_by(before, after)
        assert other != home
        assert router_decisions(http).get("load", 0) == decisions0.get("load", 0) + 1
        # the history's K/V came from the loaded replica: fetched, not computed
        moved = {
            k: after[other][k] - before[other][k]
            for k in ("kv_fetches", "kv_fetch_failures", "kv_fetched_tokens", "prefill_tokens")
        }
        assert moved["kv_fetches"] == 1 and moved["kv_fetch_failures"] == 0, moved
        assert moved["kv_fetched_tokens"] >= len(prompt) // PAGE * PAGE, moved
        assert moved["prefill_tokens"] <= len(follow_up) - moved["kv_fetched_tokens"], moved
        assert after[home]["kv_exports"] == before[home]["kv_exports"] + 1
        metrics = samples(http)
        assert metrics["kvray:kv_fetches_total"] >= 1
        assert metrics["kvray:kv_fetched_tokens_total"] >= moved["kv_fetched_tokens"]
        assert metrics["kvray:kv_fetch_seconds_count"] >= 1
        assert metrics["kvray:router_kv_source_hints_total"] >= 1
        assert text == hf_text(tokenizer_for_tiny, follow_up, hf_greedy(hf, follow_up, TURN_TOKENS))
    finally:
        for rid in rids:
            ray.get(actor.abort.remote(rid))


def test_requests_of_several_engine_calls_are_all_routed(
    server: str, hf: Any, tokenizer_for_tiny: Any
) -> None:
    """A request of n choices over several prompts makes one engine call per (prompt,
    choice), and Serve gives all of them the HTTP request's id: each must be routed."""
    import concurrent.futures as cf

    def post(i: int) -> dict[str, Any]:
        prompts = [opening(60 + i)[: 20 + i], opening(70 + i)[:24]]
        body = {"model": "tiny", "prompt": prompts, "max_tokens": TURN_TOKENS, "n": 2}
        body.update(temperature=0, ignore_eos=True)
        with httpx.Client(base_url=server, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return {"prompts": prompts, "choices": r.json()["choices"]}

    with cf.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, range(8)))
    for reply in replies:
        choices = sorted(reply["choices"], key=lambda ch: ch["index"])
        assert len(choices) == 4
        for ch in choices:
            prompt = reply["prompts"][ch["index"] // 2]
            want = hf_text(tokenizer_for_tiny, prompt, hf_greedy(hf, prompt, TURN_TOKENS))
            assert ch["text"] == want
    assert_clean()


def test_a_burst_of_new_prompts_spreads_over_both_replicas(server: str, http: httpx.Client) -> None:
    """Prompts that no engine holds, sent at once, go to the least loaded replica each:
    a choice counts as load on its replica from the moment it is made, so a burst routed
    before Serve has sent any of it does not all land on one replica."""
    import concurrent.futures as cf

    # One engine holds many more cached pages than the other (the tie-break between
    # equally loaded replicas): a burst counted only once sent would all go to the other.
    big = sorted(schedulers().items())[0][1]
    quick = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(6):
        ray.get(big.submit.remote(opening(90 + i)[:64], quick))
    deadline = time.monotonic() + 30
    while (s := ray.get(big.stats.remote()))["num_running"] + s["num_waiting"]:
        assert time.monotonic() < deadline, "the cache-filling requests did not finish"
        time.sleep(0.05)
    time.sleep(0.5)  # the router's digest follows within a step
    prompts = [opening(80 + i)[:32] for i in range(8)]
    before = stats()

    def post(prompt: list[int]) -> None:
        with httpx.Client(base_url=server, timeout=60) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0}
            r = c.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(post, prompts))
    after = stats()
    served = {
        n: (after[n]["prefix_query_tokens"] - before[n]["prefix_query_tokens"]) // 32 for n in after
    }
    assert sum(served.values()) == len(prompts), served
    assert min(served.values()) >= 2, f"the burst did not spread: {served}"


def _stream(base: str, prompt: list[int], out: dict[str, Any]) -> None:
    """One streamed completion read to its end: out["text"], out["done"], out["errors"]."""
    import json

    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0}
    body.update(stream=True, ignore_eos=True)
    out.update(text="", done=False, errors=[])
    with httpx.Client(base_url=base, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["errors"].append(event["error"])
                    else:
                        out["text"] += "".join(ch["text"] for ch in event["choices"])


def test_an_export_never_leaves_pages_locked(http: httpx.Client) -> None:
    prompt = opening(9)
    before = stats()
    complete(http, prompt)
    home = served_by(before, stats())
    holder = schedulers()[home]
    # an export hands out one copy per TP rank and unlocks as it returns
    tokens, refs = ray.get(holder.export_prefix.remote(prompt, 0))
    assert tokens >= len(prompt) // PAGE * PAGE and len(refs) == 1
    kv = ray.get(refs[0])
    assert kv.shape[2] == tokens // PAGE and kv.shape[3] == PAGE  # (2, layers, pages, ...)
    del kv, refs

    @ray.remote
    class Fetcher:
        async def take(self, holder: Any, ids: list[int]) -> Any:
            return await holder.export_prefix.remote(ids, 0)

    fetcher = Fetcher.remote()  # a fetching side that dies mid-transfer
    fetcher.take.remote(holder, prompt)
    ray.kill(fetcher)
    # a fetch from an engine that is not there: nothing imported, the request computes
    other = next(a for n, a in schedulers().items() if n != home)
    assert ray.get(other.fetch_prefix.remote(prompt, SCHEDULER_PREFIX + "gone")) == 0
    # (the `http` fixture then checks both engines: no page locked, all free after a flush)


def _start_streams(
    server: str, http: httpx.Client, prompts: list[list[int]]
) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    """Streams `prompts`, one at a time: each is admitted by an engine, and the router has
    heard of that engine's new load, before the next one is sent, so least-loaded routing
    spreads them over both engines. -> (threads, results)."""
    threads: list[threading.Thread] = []
    results: list[dict[str, Any]] = []
    for prompt in prompts:
        before = stats()
        out: dict[str, Any] = {}
        thread = threading.Thread(target=_stream, args=(server, prompt, out), daemon=True)
        thread.start()
        threads.append(thread)
        results.append(out)
        deadline = time.monotonic() + 30
        while not (moved := looked_up(before, after := stats())):
            assert time.monotonic() < deadline, "a stream was not admitted"
            time.sleep(0.02)
        (engine,) = moved
        wait_for_router_load(http, engine, after[engine]["num_running"])
    return threads, results


def test_killing_a_replica_keeps_the_app_serving(
    server: str, http: httpx.Client, hf: Any, tokenizer_for_tiny: Any
) -> None:
    """(Last in this module: it takes one replica away until Serve replaces it.)"""
    engines = schedulers()
    assert len(engines) == 2
    prompts = [opening(30 + i)[:40] for i in range(4)]
    threads, results = _start_streams(server, http, prompts)
    running = {n: s["num_running"] for n, s in stats().items()}
    assert all(running.values()), f"the streams did not spread over both engines: {running}"
    victim = sorted(engines)[0]
    # Kill the whole Serve replica (its engine's actors die with it), requests in flight.
    tag = victim[len(SCHEDULER_PREFIX) :]
    (replica,) = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{tag}")
    ]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    # Requests that arrive now never start on the dead engine: all are served.
    for i in range(4):
        prompt = opening(40 + i)[:60]
        text = complete(http, prompt)
        assert text == hf_text(tokenizer_for_tiny, prompt, hf_greedy(hf, prompt, TURN_TOKENS))
    for t in threads:
        t.join(120)
    finished = [r for r in results if r["done"] and not r["errors"]]
    assert finished, f"no stream survived on the live engine: {results}"
    assert len(finished) < len(results), "no stream was running on the killed engine"
    for r in results:  # the rest ended with a clear error, not a hang or a cut stream
        assert r["done"], r
        assert all(e["code"] == 503 for e in r["errors"]), r
    # Serve replaces the dead replica; the router takes the new one in.
    deadline = time.monotonic() + 120
    while len(schedulers()) < 2 or victim in schedulers():
        assert time.monotonic() < deadline, "the engine replica was not replaced"
        time.sleep(1.0)
    for i in range(4):
        complete(http, opening(50 + i)[:60])
