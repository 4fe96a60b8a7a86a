"""Logit processing before the choice: logit_bias, min_tokens and the repetition,
frequency and presence penalties, each against Hugging Face `generate` on the same float32
checkpoint (its own processors where it has them: `repetition_penalty`, `min_new_tokens`,
`sequence_bias`; for OpenAI's frequency and presence penalties, a processor written here
from OpenAI's definition). Processed requests batched with plain ones, drafting ones and
each other give the same tokens as alone, and a retracted one resumes with its counts;
page accounting balances after every step."""

from __future__ import annotations

from typing import Any

import pytest
from engine_checks import TINY_PROMPTS, hf_greedy, hf_processed, new_llm

from kvray import SamplingParams

N = 12  # tokens per request
# Every engine checks its integrity after each step, and is clean after each test.
pytestmark = pytest.mark.usefixtures("engine_invariants")


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoints: dict[str, Any]) -> tuple[str, Any]:
    path, hf = tiny_checkpoints["llama"]
    return str(path), hf


def processed_params(plain: list[list[int]]) -> list[SamplingParams]:
    """One request of each kind; their effect is visible on these prompts' greedy outputs
    (the stop token below is one greedy would emit early)."""
    greedy = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}
    early = plain[5][1]  # prompt 5's second greedy token
    return [
        SamplingParams(repetition_penalty=1.8, **greedy),
        SamplingParams(repetition_penalty=0.7, **greedy),
        SamplingParams(frequency_penalty=1.5, **greedy),  # (prompts 2-4 repeat tokens)
        SamplingParams(presence_penalty=2.0, frequency_penalty=-0.5, **greedy),
        SamplingParams(logit_bias={plain[4][0]: -100, 7: 8.5}, **greedy),
        SamplingParams(min_tokens=6, stop_token_ids=(early,), **greedy),
    ]


def test_each_processing_matches_hugging_face_batched_or_alone(
    tiny_llama: tuple[str, Any],
) -> None:
    path, hf = tiny_llama
    prompts = TINY_PROMPTS[:6]
    plain = [hf_greedy(hf, p, N) for p in prompts]
    params = processed_params(plain)
    want = [hf_processed(hf, p, sp) for p, sp in zip(prompts, params, strict=True)]
    # Each setting changes these outputs (the test would pass vacuously otherwise).
    changed = [w != p[: len(w)] or len(w) != N for w, p in zip(want, plain, strict=True)]
    assert all(changed), changed
    stop = params[5].stop_token_ids[0]  # held back for 6 tokens (it ended plain greedy at 2)
    assert len(want[5]) >= 6 and stop not in want[5][:5]

    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    llm = new_llm(path, speculative_tokens=3)
    # batched with each other and with plain (drafting) greedy requests
    outs = llm.generate(prompts + prompts, params + [greedy] * len(prompts))
    assert [o.token_ids for o in outs[:6]] == want
    assert [o.token_ids for o in outs[6:]] == plain
    for p, sp, w in zip(prompts, params, want, strict=True):  # alone
        assert llm.generate(p, sp)[0].token_ids == w


def test_a_retracted_request_resumes_its_penalties(tiny_llama: tuple[str, Any]) -> None:
    """A KV pool too small for the batch retracts requests mid-decode; re-admitted, their
    workers' counts are rebuilt from the tokens already output."""
    path, hf = tiny_llama
    prompts = [TINY_PROMPTS[2][:8], TINY_PROMPTS[3][:8], TINY_PROMPTS[4][:8]]
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    params = [
        SamplingParams(frequency_penalty=0.8, **greedy),
        SamplingParams(repetition_penalty=1.5, min_tokens=30, stop_token_ids=(1,), **greedy),
        SamplingParams(presence_penalty=1.0, logit_bias={9: 3.0}, **greedy),
    ]
    want = [hf_processed(hf, p, s) for p, s in zip(prompts, params, strict=True)]
    kw = {"page_size": 4, "num_pages": 16, "max_prefill_tokens": 8}  # 64 token slots
    llm = new_llm(path, **kw)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the pool was never short"  # type: ignore[attr-defined]
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens .20. must be at most max_tokens"),
        ({"logit_bias": {"a": 1}}, "logit_bias token id must be an integer"),
        ({"logit_bias": {3: 101}}, r"logit_bias\[3\] must be in \[-100, 100\]"),
    ],
)
def test_bad_processing_params_name_the_field(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused(tiny_llama: tuple[str, Any]) -> None:
    from kvray.core import RequestRejected

    path, _ = tiny_llama
    llm = new_llm(path)
    with pytest.raises(RequestRejected, match="logit_bias: token id 100000"):
        llm.generate([1, 2, 3], SamplingParams(logit_bias={100000: 1.0}))


def test_logprobs_are_the_models_before_processing(tiny_llama: tuple[str, Any]) -> None:
    """As vLLM's default (raw logprobs): a processed request's logprobs are those of the
    model's logits, not of the biased or penalized ones its tokens were chosen from, so a
    token the bias pushed out of the choice still leads the top alternatives."""
    import torch

    path, hf = tiny_llama
    prompt = TINY_PROMPTS[1]
    first = hf_greedy(hf, prompt, 1)[0]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=6,
        ignore_eos=True,
        logprobs=2,
        logit_bias={first: -100},
        repetition_penalty=1.3,
    )
    (out,) = new_llm(path).generate(prompt, sp)
    assert out.token_ids[0] != first
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    want = raw.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=1e-4)
    assert max(out.top_logprobs[0], key=out.top_logprobs[0].get) == first
    assert out.top_logprobs[0][first] == pytest.approx(raw[0, first].item(), abs=1e-4)
