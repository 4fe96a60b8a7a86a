"""Engine checks shared by the end-to-end test modules: engines that verify their own
page accounting, Hugging Face greedy references, and the tiny-checkpoint prompt set.

The fixtures built on them (`engine_invariants`, `tiny`) live in conftest.py.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvray.cluster.llm import LLM, CompletionOutput
from kvray.core import SamplingParams

# -- engines and their invariants ---------------------------------------------------------

_LIVE: list[LLM] = []  # every engine built by `new_llm` that a later check must see


def new_llm(model=None, **kw) -> LLM:
    """An LLM whose engine checks its integrity after every step, registered with
    `engine_invariants`."""
    kw.setdefault("dtype", "float32")  # "auto" would run float32 checkpoints in bfloat16
    llm = LLM(model if model is None else str(model), progress=False, **kw)
    engine = llm.engine
    step = engine.step

    def checked_step():
        events = step()
        engine.check_integrity()
        return events

    engine.step = checked_step  # type: ignore[method-assign]
    _LIVE.append(llm)
    return llm


def assert_clean(llm: LLM) -> None:
    """No leaked request, row or page: integrity holds, and after a flush every page is
    free."""
    engine = llm.engine
    engine.check_integrity()
    assert not engine.has_work, "requests left behind in the engine"
    engine.flush_cache()
    engine.check_integrity()
    sched = engine.scheduler
    assert sched.is_idle_and_empty(), (
        f"after flush: {sched.cache.num_free_pages} of {sched.config.num_pages} pages free"
    )


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_greedy(hf, ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """Hugging Face greedy generate on one unpadded prompt: the new tokens."""
    kw = {} if stop_at_eos else {"eos_token_id": None}
    # An explicit mask: without it HF masks every prompt token equal to pad_token_id
    # (SmolLM2's pad is <|im_end|>, which chat prompts contain).
    kw["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, **kw)
    return out[0, len(ids) :].tolist()


class _OpenAIPenalties:
    """HF logits processor: logit -= frequency * count + presence * (count > 0), counting
    the generated tokens only (OpenAI's definition)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processed(hf, prompt: list[int], sp: SamplingParams) -> list[int]:
    """HF greedy generate with `sp`'s logit processing, stopping where kvray stops (its
    stop_token_ids, and EOS unless ignore_eos)."""
    from transformers import LogitsProcessorList

    stop = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        eos = hf.generation_config.eos_token_id
        stop += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    kw: dict[str, Any] = {"eos_token_id": stop or None}
    if sp.repetition_penalty != 1.0:
        kw["repetition_penalty"] = sp.repetition_penalty
    if sp.min_tokens:
        kw["min_new_tokens"] = sp.min_tokens
    if sp.logit_bias:
        kw["sequence_bias"] = {(tok,): bias for tok, bias in sp.logit_bias}  # type: ignore[union-attr]
    if sp.frequency_penalty or sp.presence_penalty:
        penalties = _OpenAIPenalties(len(prompt), sp.frequency_penalty, sp.presence_penalty)
        kw["logits_processor"] = LogitsProcessorList([penalties])
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=sp.max_tokens,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def assert_same_tokens(got: list[list[int]], want: list[list[int]], what: str) -> None:
    assert len(got) == len(want)
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, f"{what}: prompts {bad} differ, e.g. #{bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


# -- tiny random checkpoints: prompts --------------------------------------------------

TINY_VOCAB = 301


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(1234)

    def rand(n: int) -> list[int]:
        return [rng.randrange(1, TINY_VOCAB) for _ in range(n)]

    base = rand(37)
    return [
        base,  # several chunks, odd length
        base[:24] + rand(9),  # shares 24 tokens with the first (page aligned for 1, 4)
        rand(5),
        rand(1),  # a one-token prompt
        base[:33] + rand(20),  # shares 33 (unaligned for every page size but 1)
        rand(16),  # exactly one 16-token page
    ]


TINY_PROMPTS = _tiny_prompts()
TINY_MAX_TOKENS = [10, 7, 12, 9, 11, 8]  # they finish at different steps


def tiny_batched_then_one_by_one(
    llm: LLM, refs: list[list[int]], what: str
) -> tuple[list[CompletionOutput], list[CompletionOutput]]:
    """TINY_PROMPTS greedy for TINY_MAX_TOKENS, all at once and then one at a time: both must
    equal `refs` (HF's tokens). Returns both runs' outputs."""
    params = [greedy(m) for m in TINY_MAX_TOKENS]
    batched = llm.generate(TINY_PROMPTS, params)
    assert_same_tokens([o.token_ids for o in batched], refs, f"{what}, batched vs HF")
    one_by_one = [llm.generate(p, sp)[0] for p, sp in zip(TINY_PROMPTS, params, strict=True)]
    assert_same_tokens([o.token_ids for o in one_by_one], refs, f"{what}, one at a time vs HF")
    return batched, one_by_one
