"""The OpenAI-compatible HTTP API on Ray Serve, end to end on the embedded SmolLM2.

One Serve app for the package (the embedded model, float32, a 64-page KV pool so the pool, not the
model, bounds the context), driven with the official `openai` client and raw `httpx`:
completions and chat (streamed and not, n, stop strings, seeds, usage, logprobs), a
malformed-input suite that must always answer 4xx with an OpenAI error body, client
disconnects that must free every page, and the Prometheus metrics.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import ray

from .serve_helpers import (
    CONTEXT,
    FRANCE,
    LONG_STREAM,
    MODEL,
    PAGE_SIZE,
    assert_engine_clean,
    chat_ids,
    metrics,
    sample,
    scheduler,
    sse_events,
)

pytestmark = [
    pytest.mark.timeout(300),
    # Ray Serve's own config models still use pydantic v1-style Field extras.
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]


# -- the happy path with the official client ----------------------------------------------------


def test_health_and_models(http: httpx.Client, client: openai.OpenAI) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = http.head("/health")  # load balancers probe with HEAD
    assert r.status_code == 200 and r.content == b""
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")


def test_chat_answers_paris_with_exact_usage(client: openai.OpenAI, tokenizer: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # ended at EOS, well before max_tokens
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, FRANCE))
    assert 1 <= r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_model_field_is_optional(http: httpx.Client) -> None:
    r = http.post(_CMPL, json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["usage"]["completion_tokens"] == 2


def test_chat_stream_equals_non_stream_and_usage_is_last(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=10,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    assert whole.usage.prompt_tokens == len(chat_ids(tokenizer, messages))

    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    # usage only on the last chunk, which has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    body = [c for c in chunks[:-1]]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in body]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])

    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_completions_stream_equals_non_stream(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The sky is blue because"
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and len(whole.choices) == 1
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].text
    assert whole.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert whole.usage.completion_tokens == 10

    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_raw_sse_framing(http: httpx.Client) -> None:
    """Server-sent events: `data: {json}` lines, ending with `data: [DONE]`."""
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events and all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_usage_counts_real_tokens(client: openai.OpenAI) -> None:
    """Token-id prompts (a batch of two) make prompt_tokens independent of the tokenizer;
    ignore_eos makes completion_tokens exactly max_tokens."""
    p1, p2 = [504, 3458, 314, 4721, 28], list(range(1000, 1013))
    r = client.completions.create(
        model=MODEL, prompt=[p1, p2], temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == len(p1) + len(p2)
    assert r.usage.completion_tokens == 2 * 5
    assert r.usage.total_tokens == len(p1) + len(p2) + 10
    # Each choice answers its own prompt: the same prompt alone gives the same greedy text.
    alone = client.completions.create(
        model=MODEL, prompt=p2, temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[1] == alone.choices[0].text


def test_prompt_exactly_filling_the_kv_pool_is_served(client: openai.OpenAI) -> None:
    """prompt + max_tokens == the pool's capacity is accepted and finishes; one more is
    rejected up front (not queued forever)."""
    prompt = [(17 * i) % 40000 + 100 for i in range(CONTEXT - 4)]
    r = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == CONTEXT - 4 and r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens"


def test_n2_gives_two_indexed_choices(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL,
        temperature=1.0,
        seed=11,
        n=2,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Write a short poem about the sea."}], **kw
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 16
    texts = [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "the two sampled choices of a seeded request are identical"

    cmpl = client.completions.create(prompt="Once upon a time", **kw)
    assert sorted(c.index for c in cmpl.choices) == [0, 1]
    assert cmpl.usage.completion_tokens == 16

    # Streamed: both indexes appear, each ends with a finish_reason, and each index's text
    # matches the non-streamed request with the same seed.
    per: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    chunks = list(
        client.completions.create(
            prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == cmpl.usage.prompt_tokens
    for c in chunks[:-1]:
        for ch in c.choices:
            per[ch.index] += ch.text
            if ch.finish_reason is not None:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert per == {c.index: c.text for c in cmpl.choices}


def test_a_choice_that_cannot_fit_refuses_the_request_before_any_runs(
    client: openai.OpenAI,
) -> None:
    """Of several prompts (x n choices), one too long for the context: a 400 naming
    `prompt`, and no sibling choice is taken and then aborted (the abort count stays)."""
    aborted0 = ray.get(scheduler().stats.remote())["num_aborted"]
    too_long = [100] * 9000
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[[100, 101], too_long], n=3, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "9000 tokens" in e.value.body["message"]
    assert ray.get(scheduler().stats.remote())["num_aborted"] == aborted0
    ok = client.completions.create(model=MODEL, prompt=[[100, 101]] * 2, n=2, max_tokens=2)
    assert len(ok.choices) == 4


def test_same_seed_same_sample_other_seed_differs(client: openai.OpenAI) -> None:
    def draw(seed: int) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="My favourite animal is the",
            temperature=1.0,
            seed=seed,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    a, b, c = draw(1234), draw(1234), draw(98765)
    assert a == b, "the same seed gave different samples"
    assert a != c, "a different seed gave the same 12-token sample"


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    prompt = "The capital of France is Paris. The capital of Germany is"
    base: dict[str, Any] = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    aborted0 = ray.get(scheduler().stats.remote())["num_aborted"]
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 12, full
    k = len(full) // 2
    stop = full[k : k + 3]
    assert stop.strip(), f"pick a better stop string from {full!r}"
    want = full[: full.index(stop)]

    r = client.completions.create(**base, stop=[stop, "\u2603never"])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16

    streamed = list(client.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"

    # chat too: a stop string cuts the assistant's answer
    answer = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24
    ).choices[0]
    assert "Paris" in answer.message.content
    cut = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=["Paris"]
    ).choices[0]
    assert cut.message.content == answer.message.content.split("Paris")[0]
    assert cut.finish_reason == "stop"
    # Ending at a stop string is a normal finish, not an abort.
    assert ray.get(scheduler().stats.remote())["num_aborted"] == aborted0


def test_include_stop_str_in_output_and_special_tokens(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    prompt = "The capital of France is Paris. The capital of Germany is"
    base: dict[str, Any] = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0]
    k = len(full.text) // 2
    stop = full.text[k : k + 3]
    kept = full.text[: full.text.index(stop) + len(stop)]
    for stream in (False, True):
        extra = {"include_stop_str_in_output": True}
        got = client.completions.create(**base, stop=stop, extra_body=extra, stream=stream)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == kept, (stream, chunks)
        assert chunks[-1].choices[0].finish_reason == "stop"
    # A stop token's text, which is otherwise not shown.
    ids = tokenizer(full.text, add_special_tokens=False)["input_ids"]
    extra = {"ignore_eos": True, "stop_token_ids": [ids[3]]}
    hidden = client.completions.create(**base, extra_body=extra).choices[0]
    shown = client.completions.create(
        **base, extra_body={**extra, "include_stop_str_in_output": True}
    ).choices[0]
    assert hidden.finish_reason == shown.finish_reason == "stop"
    assert shown.text == hidden.text + tokenizer.decode([ids[3]]), (hidden.text, shown.text)
    # skip_special_tokens: false shows a special token the model writes (here the EOS that
    # ends a reply, kept by include_stop_str_in_output).
    chat = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(**chat).choices[0]
    special = client.chat.completions.create(
        **chat, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}
    ).choices[0]
    assert plain.finish_reason == special.finish_reason == "stop"
    assert special.message.content == plain.message.content + tokenizer.eos_token


def test_chat_template_options(client: openai.OpenAI, tokenizer: Any) -> None:
    """continue_final_message: the reply carries on the last (assistant) message, exactly
    as a completion of the same rendered prompt does; add_generation_prompt: false leaves
    the assistant's header out."""
    history = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    text = tokenizer.apply_chat_template(history, tokenize=False, continue_final_message=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(
        model=MODEL, messages=history, temperature=0, max_tokens=8, extra_body=extra
    )
    same = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == same.choices[0].text
    bare = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        max_tokens=1,
        extra_body={"add_generation_prompt": False, "chat_template_kwargs": {"x": 1}},
    )
    assert bare.usage.prompt_tokens < len(chat_ids(tokenizer, FRANCE))
    no_header = tokenizer.apply_chat_template(FRANCE, tokenize=False)
    assert bare.usage.prompt_tokens == len(
        tokenizer(no_header, add_special_tokens=False)["input_ids"]
    )


def test_chat_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0.0 for v in tops)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)
    assert "".join(e.token for e in content) == choice.message.content
    # Streamed, every token's entry arrives once, also where text is held back (see
    # test_completion_logprobs).
    for stop in (None, [content[2].token + "\x07\x07"]):
        streamed = []
        for chunk in client.chat.completions.create(**kw, stop=stop, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content
        assert [e.token for e in streamed] == [e.token for e in content]
        # (the prompt now comes from the prefix cache: the same sums to within rounding)
        for got, want in zip(streamed, content, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=0.05)
    # logprobs are off unless asked for
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=6,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(**kw)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.text
    offset = 0
    for tok, v, top, off in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert v <= 0.0
        assert off == offset
        offset += len(tok)
        assert len(top) == 1 and top.get(tok) == pytest.approx(v, abs=1e-4)
    # streamed: the per-chunk logprobs add up to the same thing, also where text is held
    # back: a stop string that starts with the third token's text holds that token until
    # the fourth shows it is no stop, and its logprob goes out with the fourth's.
    for stop in (None, [lp.tokens[2] + "\x07\x07"]):
        toks, offs, chunks = [], [], 0
        for chunk in client.completions.create(**kw, stream=True, stop=stop):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                toks += chunk.choices[0].logprobs.tokens
                offs += chunk.choices[0].logprobs.text_offset
                chunks += 1
        assert toks == lp.tokens and offs == lp.text_offset
        assert chunks == (6 if stop is None else 5)


def test_logprobs_of_characters_split_over_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    """An emoji is several byte-level tokens: each keeps its own bytes (chat's `bytes`
    join to the content; no U+FFFD), top_logprobs keys stay apart (the chosen token keeps
    its own entry), and text offsets count characters of the text."""
    prompt = "Emojis: \U0001f600\U0001f603\U0001f604\U0001f601\U0001f606"
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=8,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    lp = c.logprobs
    ids = tokenizer(c.text, add_special_tokens=False)["input_ids"]
    assert any(ord(ch) > 0xFFFF for ch in c.text) and len(ids) > len(c.text)  # split characters
    assert "\ufffd" not in "".join(lp.tokens) and any("\\x" in t for t in lp.tokens)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 5 and top[tok] == pytest.approx(v, abs=1e-4)
        assert v == pytest.approx(max(top.values()), abs=1e-4)  # greedy
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[-1] <= len(c.text)  # (a character the last tokens began is dropped)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    special = {tokenizer.decode([i]) for i in tokenizer.all_special_ids}
    joined = b"".join(bytes(e.bytes) for e in content if e.token not in special)
    assert joined.decode("utf-8", errors="ignore") == chat.choices[0].message.content
    for e in content:
        assert e.top_logprobs[0].bytes == e.bytes and "\ufffd" not in e.token


# -- malformed input ----------------------------------------------------------------------------

_CHAT = "/v1/chat/completions"
_CMPL = "/v1/completions"
_MSG = [{"role": "user", "content": "hi"}]


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _MSG, "max_tokens": 2, **kw}


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# (id, method, path, body: bytes sent raw | object sent as JSON | None, status, param)
MALFORMED: list[tuple[str, str, str, Any, int, str | None]] = [
    ("bad-json", "POST", _CHAT, b'{"messages": [', 400, None),
    ("bad-json-cmpl", "POST", _CMPL, b"{prompt: 'hi'}", 400, None),
    ("not-utf8", "POST", _CMPL, b"\xff\xfe\xfa", 400, None),
    ("array-body", "POST", _CHAT, b"[1, 2, 3]", 400, None),
    ("string-body", "POST", _CMPL, b'"hello"', 400, None),
    ("number-body", "POST", _CMPL, b"42", 400, None),
    ("null-body", "POST", _CHAT, b"null", 400, None),
    ("empty-body", "POST", _CHAT, b"", 400, None),
    ("temperature-str", "POST", _CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("max-tokens-str", "POST", _CMPL, _cmpl(max_tokens="ten"), 400, "max_tokens"),
    ("messages-str", "POST", _CHAT, _chat(messages="hello"), 400, "messages"),
    ("prompt-int", "POST", _CMPL, _cmpl(prompt=5), 400, "prompt"),
    ("prompt-dict", "POST", _CMPL, _cmpl(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt-mixed", "POST", _CMPL, _cmpl(prompt=["hi", 3]), 400, "prompt"),
    ("max-tokens-neg", "POST", _CMPL, _cmpl(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "POST", _CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", "POST", _CHAT, _chat(max_tokens=10**12), 400, "max_tokens"),
    ("max-tokens-huge-cmpl", "POST", _CMPL, _cmpl(max_tokens=CONTEXT), 400, "max_tokens"),
    (
        "max-completion-tokens-zero",
        "POST",
        _CHAT,
        _chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("temperature-neg", "POST", _CHAT, _chat(temperature=-0.5), 400, "temperature"),
    ("temperature-nan", "POST", _CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("top-p-above-1", "POST", _CHAT, _chat(top_p=1.5), 400, "top_p"),
    ("top-p-zero", "POST", _CMPL, _cmpl(top_p=0), 400, "top_p"),
    ("top-k-minus-2", "POST", _CMPL, _cmpl(top_k=-2), 400, "top_k"),
    ("min-p-2", "POST", _CHAT, _chat(min_p=2), 400, "min_p"),
    ("n-zero", "POST", _CHAT, _chat(n=0), 400, "n"),
    ("n-1000", "POST", _CMPL, _cmpl(n=1000), 400, "n"),
    ("n-fraction", "POST", _CMPL, _cmpl(n=1.5), 400, "n"),
    ("seed-too-big", "POST", _CMPL, _cmpl(seed=2**70), 400, "seed"),
    ("empty-messages", "POST", _CHAT, _chat(messages=[]), 400, "messages"),
    (
        "unknown-role",
        "POST",
        _CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages",
    ),
    ("message-no-role", "POST", _CHAT, _chat(messages=[{"content": "hi"}]), 400, "messages"),
    (
        "message-content-int",
        "POST",
        _CHAT,
        _chat(messages=[{"role": "user", "content": 7}]),
        400,
        "messages",
    ),
    (
        "message-image-part",
        "POST",
        _CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        400,
        "messages",
    ),
    ("missing-messages", "POST", _CHAT, _without(_chat(), "messages"), 400, "messages"),
    ("missing-prompt", "POST", _CMPL, _without(_cmpl(), "prompt"), 400, "prompt"),
    ("empty-prompt-list", "POST", _CMPL, _cmpl(prompt=[]), 400, "prompt"),
    ("empty-token-prompt", "POST", _CMPL, _cmpl(prompt=[[]]), 400, "prompt"),
    ("empty-prompt-str", "POST", _CMPL, _cmpl(prompt=""), 400, "prompt"),
    ("prompt-too-long", "POST", _CMPL, _cmpl(prompt=[100] * (CONTEXT + 10)), 400, "prompt"),
    (
        "prompt-text-too-long",
        "POST",
        _CMPL,
        _cmpl(prompt="hello " * (CONTEXT + 10)),
        400,
        "prompt",
    ),
    (
        "chat-too-long",
        "POST",
        _CHAT,
        _chat(messages=[{"role": "user", "content": "hello " * (CONTEXT + 10)}]),
        400,
        "messages",
    ),
    ("oov-token", "POST", _CMPL, _cmpl(prompt=[10**9]), 400, "prompt"),
    ("vocab-size-token", "POST", _CMPL, _cmpl(prompt=[1, 2, 49152]), 400, "prompt"),
    ("negative-token", "POST", _CMPL, _cmpl(prompt=[5, -1]), 400, "prompt"),
    ("oov-in-batch", "POST", _CMPL, _cmpl(prompt=[[1, 2], [3, 10**9]]), 400, "prompt"),
    ("unknown-model-chat", "POST", _CHAT, _chat(model="gpt-4"), 404, "model"),
    ("unknown-model-cmpl", "POST", _CMPL, _cmpl(model="nope"), 404, "model"),
    ("presence-penalty", "POST", _CHAT, _chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty", "POST", _CMPL, _cmpl(frequency_penalty=-3), 400, "frequency_penalty"),
    ("logit-bias-key", "POST", _CHAT, _chat(logit_bias={"the": 10}), 400, "logit_bias"),
    ("logit-bias-value", "POST", _CHAT, _chat(logit_bias={"42": 101}), 400, "logit_bias"),
    ("logit-bias-oov", "POST", _CMPL, _cmpl(logit_bias={"49152": 1}), 400, "logit_bias"),
    ("min-tokens-over", "POST", _CMPL, _cmpl(min_tokens=9, max_tokens=8), 400, "min_tokens"),
    # no max_tokens: more than the default budget (the rest of the context)
    (
        "min-tokens-over-default",
        "POST",
        _CMPL,
        _without(_cmpl(min_tokens=CONTEXT), "max_tokens"),
        400,
        "min_tokens",
    ),
    ("repetition-zero", "POST", _CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty"),
    # echo would also return the prompt's logprobs, which kvray does not compute
    ("echo-with-logprobs", "POST", _CMPL, _cmpl(echo=True, logprobs=1), 400, "echo"),
    ("echo-str", "POST", _CMPL, _cmpl(echo="yes"), 400, "echo"),
    ("suffix", "POST", _CMPL, _cmpl(suffix="!"), 400, "suffix"),
    ("best-of", "POST", _CMPL, _cmpl(best_of=3), 400, "best_of"),
    ("stop-empty", "POST", _CHAT, _chat(stop=""), 400, "stop"),
    ("stop-empty-in-list", "POST", _CMPL, _cmpl(stop=["x", ""]), 400, "stop"),
    ("stop-too-many", "POST", _CHAT, _chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-int", "POST", _CMPL, _cmpl(stop=5), 400, "stop"),
    ("top-logprobs-no-logprobs", "POST", _CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    # vLLM extras kvray does not implement are refused unless neutral.
    ("prompt-logprobs", "POST", _CMPL, _cmpl(prompt_logprobs=1), 400, "prompt_logprobs"),
    ("beam-search", "POST", _CMPL, _cmpl(use_beam_search=True), 400, "use_beam_search"),
    ("bad-words", "POST", _CHAT, _chat(bad_words=["Paris"]), 400, "bad_words"),
    # vLLM would reply in the user's role, repeating the message; kvray replies as assistant
    (
        "chat-echo-user-role",
        "POST",
        _CHAT,
        _chat(echo=True, add_generation_prompt=False),
        400,
        "echo",
    ),
    ("chat-echo-int", "POST", _CHAT, _chat(echo=1), 400, "echo"),
    ("return-token-ids-str", "POST", _CMPL, _cmpl(return_token_ids="yes"), 400, "return_token_ids"),
    (
        "chat-return-token-ids-int",
        "POST",
        _CHAT,
        _chat(return_token_ids=1),
        400,
        "return_token_ids",
    ),
    (
        "continuous-usage-str",
        "POST",
        _CHAT,
        _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "on"}),
        400,
        "stream_options",
    ),
    (
        "continuous-usage-not-streaming",
        "POST",
        _CMPL,
        _cmpl(stream_options={"continuous_usage_stats": True}),
        400,
        "stream_options",
    ),
    ("chat-add-special", "POST", _CHAT, _chat(add_special_tokens=True), 400, "add_special_tokens"),
    ("chat-template", "POST", _CHAT, _chat(chat_template="{{ 1 }}"), 400, "chat_template"),
    (
        "skip-special-str",
        "POST",
        _CMPL,
        _cmpl(skip_special_tokens="no"),
        400,
        "skip_special_tokens",
    ),
    (
        "continue-and-generation-prompt",
        "POST",
        _CHAT,
        _chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    (
        "template-kwargs-reserved",
        "POST",
        _CHAT,
        _chat(chat_template_kwargs={"add_generation_prompt": False}),
        400,
        "chat_template_kwargs",
    ),
    # A check that depends on another field leaves it to that field's own error.
    ("best-of-with-bad-n", "POST", _CMPL, _cmpl(n=20, best_of=20), 400, "n"),
    (
        "top-logprobs-bad-logprobs",
        "POST",
        _CHAT,
        _chat(logprobs="yes", top_logprobs=2),
        400,
        "logprobs",
    ),
    (
        "tool-choice-bad-tools",
        "POST",
        _CHAT,
        _chat(tools=[{"type": "x"}], tool_choice="required"),
        400,
        "tools",
    ),
    ("tool-choice-auto-no-tools", "POST", _CHAT, _chat(tool_choice="auto"), 400, "tool_choice"),
    (
        "tool-choice-named-no-tools",
        "POST",
        _CHAT,
        _chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
    ),
    (
        "stream-options-not-streaming",
        "POST",
        _CMPL,
        _cmpl(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "top-logprobs-too-many",
        "POST",
        _CHAT,
        _chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
    ),
    ("cmpl-logprobs-neg", "POST", _CMPL, _cmpl(logprobs=-1), 400, "logprobs"),
    ("cmpl-logprobs-too-many", "POST", _CMPL, _cmpl(logprobs=50), 400, "logprobs"),
    (
        "stream-options-bad",
        "POST",
        _CHAT,
        _chat(stream=True, stream_options={"include_usage": "maybe"}),
        400,
        "stream_options",
    ),
    ("stream-dict", "POST", _CMPL, _cmpl(stream={"a": 1}), 400, "stream"),
    ("stop-token-ids-str", "POST", _CMPL, _cmpl(stop_token_ids=["a"]), 400, "stop_token_ids"),
    ("stop-token-ids-neg", "POST", _CMPL, _cmpl(stop_token_ids=[-3]), 400, "stop_token_ids"),
    (
        # a grammar matcher refuses an out-of-vocabulary stop token: this once failed the
        # worker on every replay (a 503) instead of being a 400
        "stop-token-ids-out-of-vocab-constrained",
        "POST",
        _CHAT,
        _chat(stop_token_ids=[10**9], guided_choice=["a", "b"]),
        400,
        "stop_token_ids",
    ),
    ("stream-too-long", "POST", _CMPL, _cmpl(stream=True, max_tokens=CONTEXT), 400, "max_tokens"),
    ("stream-unknown-model", "POST", _CHAT, _chat(stream=True, model="gpt-4"), 404, "model"),
    ("unknown-route", "POST", "/v1/embeddings", _cmpl(), 404, None),
    ("unknown-route-get", "GET", "/v2/models", None, 404, None),
    ("wrong-method-chat", "GET", _CHAT, None, 405, None),
    ("wrong-method-cmpl", "PUT", _CMPL, _cmpl(), 405, None),
    ("wrong-method-models", "POST", "/v1/models", _cmpl(), 405, None),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in MALFORMED],
)
def test_malformed_input_is_a_4xx_with_an_openai_error_body(
    http: httpx.Client, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    elif body is None:
        r = http.request(method, path)
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    body_json = r.json()
    assert set(body_json) == {"error"}, body_json
    err = body_json["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] == param, err


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e2:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e2.value.body["param"] == "model"


def test_server_still_answers_after_malformed_input(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    # Nothing a rejected request touched was left behind on the engine.
    assert_engine_clean()


# -- client disconnects -------------------------------------------------------------------------


def test_dropped_streams_free_their_pages(http: httpx.Client, server: str) -> None:
    before = metrics(http)
    aborted0 = sample(before, "kvray:num_aborted_requests", "_total")
    stats0 = assert_engine_clean()

    body = LONG_STREAM
    clients = [httpx.Client(base_url=server, timeout=120) for _ in range(10)]
    responses = []
    try:
        for i, c in enumerate(clients):
            path = _CMPL if i % 2 == 0 else _CHAT
            req_body = (
                dict(body)
                if path == _CMPL
                else {
                    **_without(body, "prompt"),
                    "messages": [{"role": "user", "content": body["prompt"]}],
                }
            )
            r = c.send(c.build_request("POST", path, json=req_body), stream=True)
            assert r.status_code == 200
            responses.append(r)
        # Read a couple of events from each: every request is now generating. The line
        # iterators stay referenced: a collected httpx iterator closes its connection.
        readers = [r.iter_lines() for r in responses]
        for lines in readers:
            got = 0
            while got < 2:
                line = next(lines)
                if line.startswith("data: "):
                    assert line != "data: [DONE]"
                    got += 1
        running = ray.get(scheduler().stats.remote())
        assert running["num_running"] + running["num_waiting"] == 10, running
        assert running["kv_cache_usage"] > 0
        # One engine replica on the ingress's node: the requests came over the ingress's
        # request channel, so the aborts below travel on it too.
        assert running["request_channels"] >= 1, running
    finally:
        for r in responses:
            r.close()
        for c in clients:
            c.close()

    stats = assert_engine_clean(timeout_s=30)
    assert stats["num_aborted"] - stats0["num_aborted"] == 10, stats
    after = metrics(http)
    assert sample(after, "kvray:num_aborted_requests", "_total") - aborted0 == 10
    assert sample(after, "kvray:num_requests_running") == 0
    assert sample(after, "kvray:num_requests_waiting") == 0


# -- metrics ------------------------------------------------------------------------------------

HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "step_compute_seconds",
)
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefill_budget_tokens",
)
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "request_success",
    "num_aborted_requests",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def test_metrics_families_are_all_there(http: httpx.Client) -> None:
    fams = metrics(http)
    expected = (
        [(h, "histogram") for h in HISTOGRAMS]
        + [(g, "gauge") for g in GAUGES]
        + [(c, "counter") for c in COUNTERS]
    )
    for name, kind in expected:
        fam = fams.get(f"kvray:{name}")
        assert fam is not None, f"kvray:{name} missing from /metrics"
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for s in fam.samples:
            assert s.labels.get("model_name") == MODEL, (s.name, s.labels)
    reasons = {
        s.labels["finished_reason"]
        for s in fams["kvray:request_success"].samples
        if s.name == "kvray:request_success_total"
    }
    assert {"stop", "length"} <= reasons
    usage = sample(fams, "kvray:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0


def test_metrics_move_with_requests(client: openai.OpenAI, http: httpx.Client) -> None:
    assert_engine_clean()  # an empty prefix cache: the first request below hits nothing
    m0 = metrics(http)

    def delta(m1: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
        return sample(m1, name, suffix, **labels) - sample(m0, name, suffix, **labels)

    prompt = [(31 * i) % 30000 + 200 for i in range(200)]  # 12 full pages and a bit
    r = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3
    m1 = metrics(http)
    assert delta(m1, "kvray:prompt_tokens", "_total") == 200
    assert delta(m1, "kvray:generation_tokens", "_total") == 3
    assert delta(m1, "kvray:request_success", "_total", finished_reason="length") == 1
    assert delta(m1, "kvray:request_success", "_total", finished_reason="stop") == 0
    assert delta(m1, "kvray:prefix_cache_queries", "_total") == 200
    assert delta(m1, "kvray:prefix_cache_hits", "_total") == 0
    assert delta(m1, "kvray:e2e_request_latency_seconds", "_count") == 1
    assert delta(m1, "kvray:time_to_first_token_seconds", "_count") == 1
    assert delta(m1, "kvray:inter_token_latency_seconds", "_count") == 2
    assert delta(m1, "kvray:request_queue_time_seconds", "_count") == 1
    assert delta(m1, "kvray:request_prompt_tokens", "_sum") == 200
    assert delta(m1, "kvray:request_generation_tokens", "_sum") == 3
    assert delta(m1, "kvray:request_generation_tokens", "_count") == 1
    assert sample(m1, "kvray:num_requests_running") == 0

    # The same long prompt again: its full pages come from the prefix cache.
    client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1)
    m2 = metrics(http)
    hits = sample(m2, "kvray:prefix_cache_hits", "_total") - sample(
        m1, "kvray:prefix_cache_hits", "_total"
    )
    assert hits >= 12 * PAGE_SIZE, hits
    assert delta(m2, "kvray:prefix_cache_queries", "_total") == 400
    assert delta(m2, "kvray:prompt_tokens", "_total") == 400

    # A chat that ends at EOS counts as a "stop" success.
    client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    m3 = metrics(http)
    assert delta(m3, "kvray:request_success", "_total", finished_reason="stop") == 1
    assert delta(m3, "kvray:request_success", "_total", finished_reason="length") == 2


# -- last: a known failure must not stop the rest under -x ----------------------------------------


def test_deeply_nested_json_is_a_400(http: httpx.Client, client: openai.OpenAI) -> None:
    """JSON nested deeper than the parser's recursion limit is malformed input too."""
    body = b"[" * 100_000 + b"]" * 100_000
    r = http.post(_CHAT, content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # and the server is still up whatever the status
    ok = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in ok.choices[0].message.content
    assert r.status_code == 400, r.text


def test_penalties_and_logit_bias_match_hugging_face(
    client: openai.OpenAI, model_dir: Any, tokenizer: Any
) -> None:
    """OpenAI's frequency / presence penalties and logit_bias, vLLM's repetition_penalty
    and min_tokens (extra_body), served: the text of the tokens Hugging Face's greedy
    generate picks with the same processing (the embedded model in float32)."""
    import torch
    import transformers
    from engine_checks import hf_greedy, hf_processed

    from kvray.core import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = "List the colors of the rainbow, then list them again:"
    ids = tokenizer(prompt)["input_ids"]
    plain = hf_greedy(hf, ids, 24)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"frequency_penalty": 1.2, "presence_penalty": 0.6}, {}),
        ({"logit_bias": {str(plain[0]): -100, str(plain[3]): 5.0}}, {}),
        ({}, {"repetition_penalty": 1.3, "min_tokens": 20}),
    ]
    for fields, extra in cases:
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body=extra,
            **fields,
        )
        given = {**fields, **extra}
        bias = {int(k): v for k, v in given.pop("logit_bias", {}).items()}
        sp = SamplingParams(temperature=0, max_tokens=24, logit_bias=bias or None, **given)
        want = hf_processed(hf, ids, sp)
        assert want != plain[: len(want)], given  # the processing shows
        assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), given
