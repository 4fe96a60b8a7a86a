"""The CUDA path, marked `gpu`: `scripts/gpu_check.sh` runs these on a GPU machine; without
one they are skipped. `KVRAY_TEST_DEVICE=cpu` runs them on CPUs instead, the Triton
kernels on the interpreter (the device script's `--dry-run`), so they cannot rot.

- float32: greedy tokens equal Hugging Face `generate` (float32, the oracle) for tiny
  random Llama / Qwen2 / Qwen3 checkpoints at page sizes 1 and 16, both cache policies,
  every prompt chunked 8 tokens a step, batched and one at a time.
- bfloat16: greedy tokens follow Hugging Face's bfloat16 `generate` on the same device
  until the first near tie, where kvray's token must be one HF ranks within its top 2 and
  within a small logit gap of its best (two bf16 implementations may round a tie either
  way; anything else is a bug).
- On CUDA, "auto" picks flash-attn when installed and its page size fits, else Triton.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from engine_checks import TINY_MAX_TOKENS, TINY_PROMPTS, assert_same_tokens, greedy, new_llm
from transformers import AutoModelForCausalLM

DEVICE = os.environ.get("KVRAY_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
# On CUDA the default choice is under test; on CPUs the interpreted Triton backend is.
BACKEND = "auto" if DEVICE == "cuda" else "triton"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE is None, reason="needs a CUDA GPU (or KVRAY_TEST_DEVICE=cpu, interpreted)"
    ),
    pytest.mark.usefixtures("engine_invariants"),
]


def _llm(path, dtype: str, page_size: int, cache: str = "radix"):
    llm = new_llm(
        path,
        dtype=dtype,
        device=DEVICE,
        page_size=page_size,
        cache_policy=cache,
        max_prefill_tokens=8,
        num_pages=512 // page_size,
        attention_backend=BACKEND,
        skip_tokenizer_init=True,
    )
    assert llm.engine.worker.device.type == DEVICE
    return llm


@pytest.mark.parametrize("cache", ["radix", "naive"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_float32_greedy_matches_hf(tiny_bare, variant: str, page_size: int, cache: str) -> None:
    path, refs = tiny_bare[variant]
    llm = _llm(path, "float32", page_size, cache)
    params = [greedy(m) for m in TINY_MAX_TOKENS]
    batched = llm.generate(TINY_PROMPTS, params)
    assert_same_tokens([o.token_ids for o in batched], refs, f"{DEVICE} batched vs HF")
    one_by_one = [llm.generate(p, sp)[0] for p, sp in zip(TINY_PROMPTS, params, strict=True)]
    assert_same_tokens([o.token_ids for o in one_by_one], refs, f"{DEVICE} one by one vs HF")


# At a divergence kvray's token must be HF's runner-up at most, within this logit gap
# (relative to the size of HF's best logit).
NEAR_TIE_RANK = 2
NEAR_TIE_GAP = 0.02


def _hf_greedy_logits(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy on DEVICE: the new tokens and their float32 logits [n, vocab]."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=DEVICE),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEVICE),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, torch.stack([step[0].float().cpu() for step in out.logits])


def assert_tracks(got: list[int], want: list[int], logits: torch.Tensor, what: str) -> None:
    """`got` equals `want` up to its first difference, which must be a near tie in the
    reference's own logits; after it the two continue from different contexts."""
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        if g == w:
            continue
        row = logits[t]
        rank = int((row > row[g]).sum()) + 1
        gap = float(row[w] - row[g])
        limit = NEAR_TIE_GAP * max(1.0, float(row[w].abs()))
        assert rank <= NEAR_TIE_RANK and gap <= limit, (
            f"{what}: token {t} is {g} (HF rank {rank}, gap {gap:.4f} > {limit:.4f}?) where "
            f"HF chose {w}: {got} vs {want}"
        )
        return


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_bfloat16_greedy_tracks_hf(tiny_bare, variant: str, page_size: int) -> None:
    path, _ = tiny_bare[variant]
    llm = _llm(path, "bfloat16", page_size)
    outs = llm.generate(TINY_PROMPTS, [greedy(m) for m in TINY_MAX_TOKENS])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    for i, (p, m, o) in enumerate(zip(TINY_PROMPTS, TINY_MAX_TOKENS, outs, strict=True)):
        want, logits = _hf_greedy_logits(hf, p, m)
        assert_tracks(o.token_ids, want, logits, f"{variant} prompt {i}")


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA default")
def test_auto_backend_on_cuda(tiny_bare) -> None:
    from kvray.attention.triton_backend import TritonAttentionBackend

    path, _ = tiny_bare["llama"]
    llm = new_llm(path, device="cuda", page_size=16, skip_tokenizer_init=True)
    attn = llm.engine.worker.attn
    if importlib.util.find_spec("flash_attn") is None:
        assert isinstance(attn, TritonAttentionBackend)
    (out,) = llm.generate(TINY_PROMPTS[0], greedy(4))
    assert len(out.token_ids) == 4
