"""OutputState, the one output path of both front ends, fed TokenEvents by hand (no engine):
the deltas add up to the text, a stop string cuts the text and wins over length, a stop
token is counted but not shown, and nothing changes once the output has finished."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvray.core import FinishReason, SamplingParams, TokenEvent
from kvray.models.embedded import ensure_embedded_model
from kvray.text import OutputDelta, OutputState

PROMPT = "Say something:"
TEXT = " Hello world, café 猫 and 🎉 done. Bye now"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(ensure_embedded_model(progress=False)))


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def state(tok, **sampling) -> OutputState:
    return OutputState(ids_of(tok, PROMPT), SamplingParams(**sampling), tok)


def feed(out: OutputState, ids: list[int], last: FinishReason | None) -> list[OutputDelta]:
    """One event per id; the last one finishes with `last` (None: none finishes)."""
    n = len(ids)
    return [
        out.add(TokenEvent(0, t, finish_reason=last if i == n - 1 else None))
        for i, t in enumerate(ids)
    ]


def test_deltas_add_up_to_the_text(tok) -> None:
    ids = ids_of(tok, TEXT)
    out = state(tok, max_tokens=len(ids))
    deltas = feed(out, ids, FinishReason.LENGTH)
    assert "".join(d.text for d in deltas) == out.text == TEXT
    assert out.token_ids == ids and [t for d in deltas for t in d.token_ids] == ids
    assert out.finish_reason is FinishReason.LENGTH and out.finished
    assert [d.finish_reason for d in deltas] == [None] * (len(ids) - 1) + [FinishReason.LENGTH]
    assert not any(d.stop_string_hit for d in deltas)


def test_a_stop_string_ends_the_request_and_cuts_the_text(tok) -> None:
    ids = ids_of(tok, TEXT)
    out = state(tok, max_tokens=100, stop=("done",))
    deltas = feed(out, ids, None)
    hits = [i for i, d in enumerate(deltas) if d.stop_string_hit]
    assert len(hits) == 1, "the caller is told once to end the request"
    k = hits[0]
    assert "done" in tok.decode(ids[: k + 1]) and "done" not in tok.decode(ids[:k])
    assert out.token_ids == ids[: k + 1], "tokens after the stop string are not output"
    assert not out.finished, "the finishing event finishes the output, not the stop string"
    last = out.add(TokenEvent(0, None, finish_reason=FinishReason.STOP, num_cached_tokens=3))
    assert out.finish_reason is last.finish_reason is FinishReason.STOP
    assert out.text == TEXT[: TEXT.index("done")]
    assert "".join(d.text for d in [*deltas, last]) == out.text
    assert out.num_cached_tokens == 3


def test_a_stop_string_wins_over_the_finish_that_came_with_it(tok) -> None:
    """The token that completes the stop string is the last one allowed (length): the text
    is cut and the reason is `stop`. (A stop token cannot complete one: its text is not
    output.)"""
    ids = ids_of(tok, TEXT)
    k = next(i for i in range(len(ids)) if "world" in tok.decode(ids[: i + 1]))
    out = state(tok, max_tokens=k + 1, stop=("world",))
    deltas = feed(out, ids[: k + 1], FinishReason.LENGTH)
    assert out.finish_reason is deltas[-1].finish_reason is FinishReason.STOP
    assert not any(d.stop_string_hit for d in deltas), "already finished: nothing to end"
    assert out.text == " Hello " == "".join(d.text for d in deltas)


@pytest.mark.parametrize("word", ["world", "done"])
@pytest.mark.parametrize("other", [(), ("a much longer stop string",)])
def test_stop_strings_count_from_the_token_after_min_tokens(tok, word, other) -> None:
    """As vLLM: a stop string that a request's first min_tokens tokens complete does not
    end it (nor is it found later, also beside a longer stop string that widens the text
    held back); one completed by a later token does."""
    ids = ids_of(tok, TEXT)
    world = next(i for i in range(len(ids)) if "world" in tok.decode(ids[: i + 1]))
    out = state(tok, max_tokens=100, min_tokens=world + 1, stop=(word, *other))
    deltas = feed(out, ids, None)
    hits = [i for i, d in enumerate(deltas) if d.stop_string_hit]
    if word == "world":  # completed by token min_tokens: never a stop
        assert hits == [] and out.token_ids == ids
        out.add(TokenEvent(0, None, finish_reason=FinishReason.LENGTH))
        assert out.text == TEXT and out.finish_reason is FinishReason.LENGTH
    else:
        assert len(hits) == 1 and hits[0] > world
        assert out.text == TEXT[: TEXT.index("done")]


def test_text_held_back_as_a_possible_stop_string_is_released_at_the_end(tok) -> None:
    ids = ids_of(tok, " Hello wor")
    out = state(tok, max_tokens=len(ids), stop=("world",))
    deltas = feed(out, ids, FinishReason.LENGTH)
    assert "wor" not in "".join(d.text for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == out.text == " Hello wor"
    assert out.finish_reason is FinishReason.LENGTH


def test_a_stop_token_is_counted_but_its_text_is_not_shown(tok) -> None:
    ids = ids_of(tok, " Hello world")
    out = state(tok, max_tokens=100, stop_token_ids=(ids[-1],))
    deltas = feed(out, ids, FinishReason.STOP)
    assert out.token_ids == ids and out.finish_reason is FinishReason.STOP
    assert out.text == tok.decode(ids[:-1]) == "".join(d.text for d in deltas)


def test_include_stop_str_in_output_shows_the_stop_token_and_the_stop_string(tok) -> None:
    ids = ids_of(tok, " Hello world")
    out = state(tok, max_tokens=100, stop_token_ids=(ids[-1],), include_stop_str_in_output=True)
    feed(out, ids, FinishReason.STOP)
    assert out.text == " Hello world" and out.finish_reason is FinishReason.STOP
    out = state(tok, max_tokens=100, stop=["wor"], include_stop_str_in_output=True)
    deltas = feed(out, ids_of(tok, TEXT), None)
    assert out.text == " Hello wor" == "".join(d.text for d in deltas)
    assert sum(d.stop_string_hit for d in deltas) == 1


@pytest.mark.parametrize("include", [False, True])
def test_an_eos_is_shown_only_with_special_tokens_and_include_stop(tok, include) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    mid = ids_of(tok, " Hi") + [eos] + ids_of(tok, " ok")
    kw = {"max_tokens": 100, "skip_special_tokens": False, "include_stop_str_in_output": include}
    out = state(tok, **kw)
    feed(out, [*mid, eos], FinishReason.STOP)  # the engine stopped on EOS
    assert out.text == " Hi<|im_end|> ok" + ("<|im_end|>" if include else "")
    out = state(tok, max_tokens=100, include_stop_str_in_output=include)
    feed(out, [*mid, eos], FinishReason.STOP)
    assert out.text == " Hi ok"  # special tokens skipped: the EOS has no text either way


def test_events_after_the_finish_are_ignored(tok) -> None:
    ids = ids_of(tok, " Hello world")
    out = state(tok, max_tokens=len(ids), logprobs=0)
    out.add(TokenEvent(0, ids[0], logprob=-0.5, finish_reason=FinishReason.LENGTH))
    before = (out.text, list(out.token_ids), list(out.logprobs), out.finish_reason)
    for ev in [
        TokenEvent(0, ids[1], logprob=-1.0),
        TokenEvent(0, None, finish_reason=FinishReason.ABORT),
    ]:
        assert out.add(ev) == OutputDelta()
    assert (out.text, out.token_ids, out.logprobs, out.finish_reason) == before
    assert out.logprobs == [(ids[0], -0.5, None)]


def test_without_a_tokenizer_only_token_ids(tok) -> None:
    out = OutputState([1, 2], SamplingParams(max_tokens=2), None)
    deltas = feed(out, [5, 6], FinishReason.LENGTH)
    assert out.token_ids == [5, 6] and out.text == "" and not any(d.text for d in deltas)
    assert out.finish_reason is FinishReason.LENGTH and deltas[-1].shows_something
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        OutputState([1], SamplingParams(stop=("x",)), None)
