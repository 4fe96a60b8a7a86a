"""Speculative decoding with n-gram drafts: exactly greedy's tokens, in fewer steps.

The tiny random checkpoints fall into loops within a few dozen greedy tokens, as small
models do, so their drafts are often right and sometimes wrong: both paths run.
"""

from __future__ import annotations

import random

import pytest
from engine_checks import TINY_PROMPTS, TINY_VOCAB, assert_same_tokens, greedy, hf_greedy, new_llm

from kvray.core import SamplingParams
from kvray.scheduler.ngram import NgramIndex

pytestmark = pytest.mark.usefixtures("engine_invariants")

MAX_NEW = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(99)
    loop = [rng.randrange(1, TINY_VOCAB) for _ in range(6)]
    return [*TINY_PROMPTS, loop * 4, [rng.randrange(1, TINY_VOCAB) for _ in range(50)]]


PROMPTS = _prompts()


def test_ngram_index_drafts_what_followed_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    ids = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" occurred twice before the end: the latest one was followed by 9, 2, 6.
    assert index.draft(ids, 3) == [9, 2, 6]
    # A longer match beats a more recent shorter one: "1 6 7" only at 4, then 9.
    ids += [9, 3, 1, 6, 7]
    assert index.draft(ids, 2) == [9, 2]
    assert index.draft(ids + [4], 2) == []  # 4 never occurred before
    # The draft stops at the end of what is known.
    assert NgramIndex(1, 3).draft([1, 2, 1], 5) == [2, 1]
    assert NgramIndex(2, 3).draft([1, 2, 1], 5) == []  # 1-grams are below the minimum


@pytest.mark.parametrize(
    ("variant", "page_size", "cache", "k"),
    [
        ("llama", 1, "radix", 4),
        ("qwen2", 4, "naive", 2),
        ("qwen3", 16, "radix", 4),
        ("llama", 16, "naive", 1),
    ],
)
def test_tiny_greedy_with_drafts_matches_hf(
    tiny_checkpoints, variant: str, page_size: int, cache: str, k: int
) -> None:
    path, hf = tiny_checkpoints[variant]
    want = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = new_llm(
        path,
        page_size=page_size,
        cache_policy=cache,
        num_pages=4096 // page_size,
        max_prefill_tokens=16,
        speculative_tokens=k,
    )
    outs = llm.generate(PROMPTS, greedy(MAX_NEW))
    assert_same_tokens([o.token_ids for o in outs], want, f"{variant} with {k} drafts vs HF")
    stats = llm.engine.scheduler.stats
    assert stats.accepted_draft_tokens > 0, "no draft ever held"
    assert stats.draft_tokens > stats.accepted_draft_tokens, "no draft ever missed"
    # Every held draft is a step saved.
    decode_steps = stats.steps - stats.accepted_draft_tokens
    assert decode_steps < len(PROMPTS) * MAX_NEW
    # One at a time, and the prompts cached (radix) or not: the same tokens.
    alone = [llm.generate(p, greedy(MAX_NEW))[0].token_ids for p in PROMPTS[-2:]]
    assert_same_tokens(alone, want[-2:], f"{variant} with drafts, one at a time vs HF")


def test_stops_and_lengths_inside_a_held_draft(tiny_checkpoints) -> None:
    """A stop token or max_tokens that falls inside a run of held drafts ends the request
    at that token: nothing after it is output."""
    path, hf = tiny_checkpoints["llama"]
    prompt = PROMPTS[-2]
    ref = hf_greedy(hf, prompt, MAX_NEW)
    llm = new_llm(path, page_size=4, num_pages=1024, speculative_tokens=4)
    stop = ref[30]
    first = ref.index(stop)
    out = llm.generate(prompt, greedy(MAX_NEW, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    for n in (1, 2, 7, 23):
        out = llm.generate(prompt, greedy(n))[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    assert llm.engine.scheduler.stats.accepted_draft_tokens > 0


def test_requests_that_sample_or_ask_for_logprobs_decode_beside_drafts(tiny_checkpoints) -> None:
    """Only plain greedy requests draft: a seeded sampling request and a greedy one with
    logprobs get what they get without speculative decoding, in the same batch."""
    path, hf = tiny_checkpoints["qwen2"]
    prompts = [PROMPTS[-2], PROMPTS[-3], PROMPTS[-1]]  # the greedy one loops
    params = [
        greedy(MAX_NEW),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=MAX_NEW, ignore_eos=True),
        greedy(MAX_NEW, logprobs=2),
    ]
    plain = new_llm(path, page_size=4, num_pages=1024)
    want = plain.generate(prompts, params)
    llm = new_llm(path, page_size=4, num_pages=1024, speculative_tokens=4)
    got = llm.generate(prompts, params)
    assert got[0].token_ids == hf_greedy(hf, prompts[0], MAX_NEW)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
    assert got[2].logprobs == pytest.approx(want[2].logprobs, abs=1e-4)
    assert llm.engine.scheduler.stats.accepted_draft_tokens > 0


def test_aborting_a_drafting_request_frees_its_pages(tiny_checkpoints) -> None:
    path, _ = tiny_checkpoints["llama"]
    llm = new_llm(path, page_size=4, num_pages=256, speculative_tokens=4)
    engine = llm.engine
    rids = [engine.add_request(p, greedy(200)) for p in PROMPTS[-2:]]
    while engine.scheduler.stats.accepted_draft_tokens < 8:
        engine.step()
    for rid in rids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()


def test_a_stop_string_cuts_the_text_where_drafts_hold(tiny_checkpoints) -> None:
    """The front end sees a step's tokens one by one: a stop string completed late in the
    output, where drafts hold (a step gives several tokens), cuts the text there, as it
    does one token a step."""
    path, hf = tiny_checkpoints["llama"]
    llm = new_llm(path, page_size=4, num_pages=1024, speculative_tokens=4)
    prompt = PROMPTS[-2]
    ref = hf_greedy(hf, prompt, MAX_NEW)
    tok = llm.tokenizer
    text = tok.decode(ref, skip_special_tokens=True)
    for k in range(24, MAX_NEW - 2):  # a stop string of tokens k and k + 1, first seen there
        at = len(tok.decode(ref[:k], skip_special_tokens=True))
        stop = text[at : len(tok.decode(ref[: k + 2], skip_special_tokens=True))]
        if len(stop) >= 2 and text.find(stop) == at:
            break
    else:
        pytest.fail(f"no usable stop string in {text!r}")
    (out,) = llm.generate(prompt, greedy(MAX_NEW, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == text[:at]
    assert llm.engine.scheduler.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_drafts_on_the_other_attention_backends(tiny_checkpoints, backend: str) -> None:
    """The checked positions attend as decodes on every backend: torch's SDPA, and the
    Triton kernel that GPUs run (here under its interpreter)."""
    path, hf = tiny_checkpoints["qwen3"]
    prompts = PROMPTS[-2:]
    want = [hf_greedy(hf, p, 24) for p in prompts]
    llm = new_llm(
        path, page_size=4, num_pages=1024, speculative_tokens=4, attention_backend=backend
    )
    outs = llm.generate(prompts, greedy(24))
    assert_same_tokens([o.token_ids for o in outs], want, f"drafts on {backend} vs HF")
    assert llm.engine.scheduler.stats.accepted_draft_tokens > 0
