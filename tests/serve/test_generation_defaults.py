"""What a request leaves unset defaults to, as in vLLM: the checkpoint's own sampling
settings (generation_config.json, which the engine reports in its limits), or OpenAI's with
`generation_config: none` (vLLM's `--generation-config vllm`). Checked on the requests the
server prepares for the engine (no engine needed: preparation is where defaults apply)."""

from __future__ import annotations

import pytest

from kvray.deploy.generation import EngineLimits
from kvray.deploy.prepare import Preparer
from kvray.deploy.protocol import ChatCompletionRequest, CompletionRequest
from kvray.deploy.settings import ServeConfig
from kvray.models.embedded import ensure_embedded_model
from kvray.text import load_tokenizer

QWEN3_LIKE = (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20), ("max_tokens", 300))
CONTEXT = 2048
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model(progress=False))


def preparer(tokenizer, **settings) -> Preparer:
    return Preparer(tokenizer, EngineLimits(CONTEXT, 49152, QWEN3_LIKE), ServeConfig(**settings))


def test_unset_settings_are_the_checkpoints(tokenizer) -> None:
    prep = preparer(tokenizer)
    (job,) = prep.completion(CompletionRequest(prompt="Hello")).jobs
    sp = job.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.6, 0.95, 20, 0.0)
    assert sp.max_tokens == 16  # (completions' own default, OpenAI's and vLLM's)
    (job,) = prep.chat(ChatCompletionRequest(messages=HI)).jobs
    assert job.sampling.max_tokens == 300  # max_new_tokens bounds the default budget
    chat = ChatCompletionRequest(messages=HI, temperature=0, top_k=-1, max_tokens=7)
    (job,) = prep.chat(chat).jobs
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.top_p) == (0.0, -1, 0.95)
    assert job.sampling.max_tokens == 7
    # the server's own default, when smaller, still bounds the budget
    (job,) = (
        preparer(tokenizer, max_tokens_default=50).chat(ChatCompletionRequest(messages=HI)).jobs
    )
    assert job.sampling.max_tokens == 50


@pytest.mark.parametrize("value", ["none", "vllm"])
def test_generation_config_none_is_openais_defaults(tokenizer, value: str) -> None:
    (job,) = (
        preparer(tokenizer, generation_config=value).chat(ChatCompletionRequest(messages=HI)).jobs
    )
    sp = job.sampling
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, -1)
    assert sp.max_tokens == CONTEXT - len(job.prompt_ids)
