"""IncrementalDetokenizer with the embedded SmolLM2 tokenizer (byte-level BPE, so emoji,
CJK and accented letters are split across tokens byte-wise): the streamed deltas add up
to `tokenizer.decode`, never show a half character, and stop strings cut the text before
the stop string without leaking what was held back."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvray.models.embedded import ensure_embedded_model
from kvray.text import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

MULTIBYTE_TEXTS = [
    "Café crème brûlée, naïve — Dvořák in Łódź met Nguyễn Đặng (Ångström).",
    "日本語のテキストと中文字符测试。東京は晴れです。",
    "Party 🎉🚀 time 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!",
    "Ünïcödé ñ ø å 😀x Ω≈ç√∫ ½ €100",
    "mixed: abc 한국어 텍스트 ελληνικά العربية 🙂",
    "🎉",  # one character, several tokens
]
PROMPTS = ["", "Say something:", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(ensure_embedded_model(progress=False)))


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def stream(
    tok, prompt: str, ids: list[int], stop=(), include: bool = False
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push every id; returns the detokenizer and every delta, the flush's last."""
    d = IncrementalDetokenizer(tok, encode(tok, prompt), stop, include_stop=include)
    deltas = [d.push(t) for t in ids]
    deltas.append(d.flush())
    return d, deltas


def test_texts_really_split_characters(tok) -> None:
    """The premise of the tests below: single tokens decode to half characters."""
    for text in MULTIBYTE_TEXTS:
        pieces = [tok.decode([t]) for t in encode(tok, text)]
        assert any(REPLACEMENT in p for p in pieces), text


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_deltas_add_up_to_decode(tok, prompt: str, text: str) -> None:
    ids = encode(tok, text)
    d, deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.text == text and not d.stopped
    assert not [x for x in deltas if REPLACEMENT in x], deltas
    assert deltas[-1] == "", "the text ended on a whole character: nothing was left to flush"


def test_special_tokens_are_skipped(tok) -> None:
    ids = encode(tok, "Hi 🎉") + [tok.convert_tokens_to_ids("<|im_end|>")] + encode(tok, " ok")
    d, deltas = stream(tok, "Q:", ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hi 🎉 ok"
    shown = IncrementalDetokenizer(tok, encode(tok, "Q:"), skip_special_tokens=False)
    text = "".join([shown.push(t) for t in ids] + [shown.flush()])
    assert text == tok.decode(ids) == "Hi 🎉<|im_end|> ok"


def test_every_prefix_streams_whole_characters(tok) -> None:
    """Cut anywhere, even inside a character: only whole characters are ever shown, and
    the flush drops an unfinished one (as vLLM does) instead of showing U+FFFD for it."""
    text = MULTIBYTE_TEXTS[2] + MULTIBYTE_TEXTS[1]
    ids = encode(tok, text)
    for n in range(1, len(ids) + 1):
        d, deltas = stream(tok, "x", ids[:n])
        whole = "".join(deltas)
        assert REPLACEMENT not in whole
        assert text.startswith(whole)
        assert whole == tok.decode(ids[:n], skip_special_tokens=True).rstrip(REPLACEMENT)


def _expected_cut(text: str, stops: list[str], include: bool = False) -> str:
    """Before the stop string that starts first (the first listed of those starting there),
    or after it with `include`."""
    hits = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text
    at, length = min(hits, key=lambda hit: hit[0])
    return text[: at + length if include else at]


def _check_stop_stream(
    tok, text: str, stops: list[str], prompt: str = "Go:", include: bool = False
) -> None:
    ids = encode(tok, text)
    want = _expected_cut(text, stops, include)
    d, deltas = stream(tok, prompt, ids, stops, include)
    assert "".join(deltas) == want == d.text, (stops, deltas)
    assert d.stopped == any(s in text for s in stops)
    assert not [x for x in deltas if REPLACEMENT in x]
    # Nothing at or after the cut was ever shown, not even for a moment.
    shown = ""
    for x in deltas:
        shown += x
        assert want.startswith(shown), (shown, want)


def test_stop_string_spanning_tokens(tok) -> None:
    text = "Hello world, this is a test of stop strings in a stream."
    ids = encode(tok, text)
    bounds = [len(tok.decode(ids[:k])) for k in range(1, len(ids))]
    spanning = 0
    for b in bounds:
        stop = text[b - 2 : b + 3]
        if len(stop) == 5 and text.find(stop) == b - 2:
            _check_stop_stream(tok, text, [stop])
            spanning += 1
    assert spanning >= 5


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop"])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS[:5])
def test_multibyte_stop_strings(tok, text: str, include: bool) -> None:
    """Stop strings made of split characters, at every character offset."""
    for i in range(0, len(text) - 1, 3):
        _check_stop_stream(tok, text, [text[i : i + 2]], include=include)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop"])
def test_stop_string_the_earliest_wins(tok, include: bool) -> None:
    text = "this is a test, and it is fine"
    _check_stop_stream(tok, text, ["test", "is"], include=include)  # "is" in "this" is first
    _check_stop_stream(tok, text, ["fine", ", and"], include=include)
    _check_stop_stream(tok, text, ["this"], include=include)  # at the very start
    # Streamed, the stop string that completes first wins (here the shorter of two that
    # start at the same place), so nothing past it is ever shown.
    d, deltas = stream(tok, "Go:", encode(tok, text), ["a test, and", "a t"], include)
    assert "".join(deltas) == d.text == ("this is a t" if include else "this is ")


def test_include_stop_keeps_the_stop_string_and_nothing_after(tok) -> None:
    d, deltas = stream(tok, "Q:", encode(tok, "Hello world! Bye"), ["world"], include=True)
    assert "".join(deltas) == d.text == "Hello world" and d.stopped


def test_held_back_prefix_does_not_leak_when_the_stop_completes(tok) -> None:
    text = "Hello world! Bye"
    ids = encode(tok, text)
    d = IncrementalDetokenizer(tok, encode(tok, "Q:"), ["world!"])
    shown = ""
    for t in ids:
        shown += d.push(t)
        if d.text.endswith("world") and not d.stopped:
            # "world" may begin the stop string: it is held back.
            assert shown == "Hello ", shown
        if d.stopped:
            break
    assert d.stopped
    assert shown == "Hello "
    assert d.push(encode(tok, " more")[0]) == "" and d.flush() == ""
    assert d.text == "Hello "


def test_stop_prefix_that_breaks_off_is_released(tok) -> None:
    text = "Hello world peace and world order"
    _check_stop_stream(tok, text, ["world!"])
    d, deltas = stream(tok, "Q:", encode(tok, text), ["world!"])
    assert not d.stopped and "".join(deltas) == text


def test_stop_prefix_that_never_completes_is_released_by_flush(tok) -> None:
    text = "The answer is 42 and the end"
    ids = encode(tok, text)
    d = IncrementalDetokenizer(tok, encode(tok, "Q:"), ["end.", "42!"])
    shown = "".join(d.push(t) for t in ids)
    assert not d.stopped
    assert shown == "The answer is 42 and the "  # "end" could begin "end." (and "42" "42!")
    assert d.flush() == "end"
    assert d.text == text
    # Flushing again returns nothing more.
    assert d.flush() == ""


def test_stop_string_around_split_emoji(tok) -> None:
    text = "Launch 🚀 now, then 🎉 party"
    for stop in ["🚀", " 🚀 n", "🎉 p", "n 🎉"]:
        _check_stop_stream(tok, text, [stop])
    # An emoji that only shares its first bytes with the stop string does not match.
    _check_stop_stream(tok, text, ["🚁"])
