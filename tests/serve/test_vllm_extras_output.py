"""vLLM's output extras, over real HTTP to the package's Serve app: `return_token_ids`
(the prompt's and each choice's token ids), `stream_options.continuous_usage_stats` (usage
on every chunk) and `echo` (the prompt before the text). Streamed and not, n=2; each
request generates a handful of tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .serve_helpers import FRANCE, assert_engine_clean, chat_ids, sse_events

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
USAGE_EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module", autouse=True)
def clean_engine(server: str) -> Iterator[None]:
    yield
    assert_engine_clean()


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def by_index(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's chunks, in order, with the event's usage and prompt_token_ids."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        assert len(e["choices"]) <= 1
        for c in e["choices"]:
            extra = {k: e[k] for k in ("usage", "prompt_token_ids") if k in e}
            out.setdefault(c["index"], []).append({**c, **extra})
    return out


def check_running_usage(chunks: list[dict[str, Any]], prompt_tokens: int) -> None:
    """continuous_usage_stats: every chunk of a choice counts its prompt and the tokens it
    has generated so far (the ids sent so far, with return_token_ids), as vLLM does."""
    sent = 0
    for c in chunks:
        sent += len(c.get("token_ids", []))
        assert c["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sent,
            "total_tokens": prompt_tokens + sent,
        }, c


# -- return_token_ids and continuous_usage_stats ------------------------------------------------


def test_completion_token_ids_whole_and_streamed(http: httpx.Client, tokenizer: Any) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    whole = post(http, CMPL, body)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    for c in whole["choices"]:  # vLLM's placement: both on the choice
        assert c["prompt_token_ids"] == prompt_ids
        assert len(c["token_ids"]) == 5 and tokenizer.decode(c["token_ids"]) == c["text"]
    assert whole["choices"][0]["token_ids"] != whole["choices"][1]["token_ids"]
    assert whole["usage"]["completion_tokens"] == 10

    events = stream(http, CMPL, {**body, "stream_options": USAGE_EVERY_CHUNK})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    chunks = by_index(events[:-1])
    assert sorted(chunks) == [0, 1]
    for i, own in chunks.items():
        # the first chunk of a choice carries its prompt's ids, every chunk its new ids
        assert own[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in own[1:])
        assert [t for c in own for t in c["token_ids"]] == whole["choices"][i]["token_ids"]
        assert "".join(c["text"] for c in own) == whole["choices"][i]["text"]
        check_running_usage(own, len(prompt_ids))

    # Asked for neither: no ids, and continuous_usage_stats without include_usage adds no
    # usage (as in vLLM: it only makes the usage asked for continuous).
    plain = {k: v for k, v in body.items() if k != "return_token_ids"}
    events = stream(http, CMPL, {**plain, "stream_options": {"continuous_usage_stats": True}})
    assert all(e["usage"] is None and e["choices"] for e in events)
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in events[0]["choices"])
    assert "token_ids" not in post(http, CMPL, plain)["choices"][0]


def test_ids_of_held_back_text_come_with_the_next_chunk(http: httpx.Client) -> None:
    """A token whose text may begin a stop string shows nothing yet; its id goes out with
    the next chunk sent, so the stream still carries every id, in order."""
    body = {
        "prompt": "1, 2, 3, 4, 5,",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [", 99"],  # a text ending in "," waits for the next token
        "return_token_ids": True,
    }
    whole = post(http, CMPL, body)["choices"][0]
    chunks = by_index(stream(http, CMPL, body))[0]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert any(len(c["token_ids"]) > 1 for c in chunks), chunks


def test_chat_token_ids_whole_and_streamed(http: httpx.Client, tokenizer: Any) -> None:
    body = {
        "messages": FRANCE,
        "max_tokens": 24,
        "n": 2,
        "temperature": 0,
        "return_token_ids": True,
    }
    prompt_ids = chat_ids(tokenizer, FRANCE)
    whole = post(http, CHAT, body)
    assert whole["prompt_token_ids"] == prompt_ids  # vLLM's placement: on the response
    for c in whole["choices"]:
        assert "prompt_token_ids" not in c
        ids, content = c["token_ids"], c["message"]["content"]
        assert c["finish_reason"] == "stop" and "Paris" in content
        # the stop token that ended the reply is among the ids generated, as in vLLM
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids) == content + tokenizer.eos_token
    assert whole["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in whole["choices"])

    events = stream(http, CHAT, {**body, "stream_options": USAGE_EVERY_CHUNK})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert "prompt_token_ids" not in events[-1]
    chunks = by_index(events[:-1])
    for i, own in chunks.items():
        role, rest = own[0], own[1:]
        assert role["delta"] == {"role": "assistant", "content": ""} and "token_ids" not in role
        assert role["prompt_token_ids"] == prompt_ids  # each choice's first chunk
        assert all("prompt_token_ids" not in c for c in rest)
        ids = [t for c in rest for t in c["token_ids"]]
        assert ids == whole["choices"][i]["token_ids"]
        text = "".join(c["delta"].get("content") or "" for c in rest)
        assert text == whole["choices"][i]["message"]["content"]
        check_running_usage(own, len(prompt_ids))

    plain = {k: v for k, v in body.items() if k != "return_token_ids"}
    whole = post(http, CHAT, {**plain, "n": 1})
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]


# -- echo -----------------------------------------------------------------------------------


def test_completion_echo_whole_and_streamed(http: httpx.Client, tokenizer: Any) -> None:
    other = " Once upon a time"
    body = {
        "prompt": [PROMPT, other],  # two prompts, n=2: four choices
        "max_tokens": 3,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    plain = post(http, CMPL, body)
    whole = post(http, CMPL, {**body, "echo": True})
    prompts = [PROMPT, PROMPT, other, other]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for c, before, prompt in zip(whole["choices"], plain["choices"], prompts, strict=True):
        assert c["text"] == prompt + before["text"], c
    assert whole["usage"] == plain["usage"]  # the echo is not generated

    events = stream(http, CMPL, {**body, "echo": True, "stream_options": USAGE_EVERY_CHUNK})
    assert events[-1]["usage"] == plain["usage"]
    chunks = by_index(events[:-1])
    prompt_lens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert sorted(chunks) == [0, 1, 2, 3]
    for i, own in chunks.items():
        assert own[0]["text"].startswith(prompts[i])  # the prompt comes first
        assert "".join(c["text"] for c in own) == whole["choices"][i]["text"]
        assert [c["usage"]["prompt_tokens"] for c in own] == [prompt_lens[i]] * len(own)

    # a token-id prompt is echoed as its text
    ids = tokenizer(other)["input_ids"]
    echoed = post(http, CMPL, {**body, "prompt": ids, "n": 1, "echo": True})
    assert echoed["choices"][0]["text"] == tokenizer.decode(ids) + plain["choices"][2]["text"]

    # echo with logprobs would need the prompt's logprobs: a 400 that says so
    r = http.post(CMPL, json={**body, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert "logprobs" in r.json()["error"]["message"]


def test_chat_echo_repeats_the_assistant_message(http: httpx.Client) -> None:
    prefill = "The capital of France is"
    body = {
        "messages": [*FRANCE, {"role": "assistant", "content": prefill}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 3,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    plain = post(http, CHAT, body)
    whole = post(http, CHAT, {**body, "echo": True})
    for c, before in zip(whole["choices"], plain["choices"], strict=True):
        assert c["message"]["content"] == prefill + before["message"]["content"]

    events = stream(http, CHAT, {**body, "echo": True})
    chunks = by_index(events)
    for i, own in chunks.items():
        assert own[0]["delta"] == {"role": "assistant", "content": ""}
        assert own[1]["delta"] == {"content": prefill}  # as vLLM: right after the role
        text = "".join(c["delta"].get("content") or "" for c in own)
        assert text == whole["choices"][i]["message"]["content"]

    # a last message that is not the assistant's is not repeated (vLLM's rule)
    asked = {"messages": FRANCE, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    content = post(http, CHAT, asked)["choices"][0]["message"]["content"]
    assert post(http, CHAT, {**asked, "echo": True})["choices"][0]["message"]["content"] == content
