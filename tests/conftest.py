"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os

import pytest
import torch
from engine_checks import _LIVE, TINY_MAX_TOKENS, TINY_PROMPTS, assert_clean, hf_greedy

from kvray.bench.tiny import write_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels (the "triton" attention backend) run on the interpreter here; the
    # variable must be set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- tiny random checkpoints (shared by end-to-end tests) -----------------------------------

TINY_VARIANTS = {
    # kind, extra config: GQA with tied embeddings; qkv bias with an untied LM head;
    # q/k RMSNorm with a head_dim that is not hidden / heads.
    "llama": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)),
}


def build_tiny_checkpoint(kind: str, path, seed: int = 0, tokenizer: bool = True, **kw):
    """A tiny random `kind` checkpoint with the SmolLM2 tokenizer beside it (so the
    directory loads as a whole model); returns the Hugging Face reference model."""
    return write_tiny_checkpoint(path, kind, seed, tokenizer, **kw)


@pytest.fixture(scope="session")
def ray_session() -> None:
    """One local Ray cluster for the whole test session (Ray takes seconds to start)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """Every TINY_VARIANTS entry saved once per session (with a tokenizer):
    {name: (checkpoint dir, Hugging Face model)}."""
    out = {}
    for name, (kind, kw) in TINY_VARIANTS.items():
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (path, build_tiny_checkpoint(kind, path, **kw))
    return out


def _with_refs(checkpoints: dict) -> dict[str, tuple[str, list[list[int]]]]:
    """{variant: (checkpoint dir, HF greedy reference for each TINY_PROMPTS entry)}."""
    out = {}
    for name, (path, hf) in checkpoints.items():
        refs = [hf_greedy(hf, p, m) for p, m in zip(TINY_PROMPTS, TINY_MAX_TOKENS, strict=True)]
        out[name] = (str(path), refs)
    return out


@pytest.fixture(scope="session")
def tiny(tiny_checkpoints) -> dict[str, tuple[str, list[list[int]]]]:
    """{variant: (checkpoint dir, HF greedy reference for each TINY_PROMPTS entry)}."""
    return _with_refs(tiny_checkpoints)


@pytest.fixture(scope="session")
def tiny_bare(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """As `tiny`, saved without a tokenizer: a GPU machine has no embedded model to take
    one from (load them with `skip_tokenizer_init=True`)."""
    checkpoints = {}
    for name, (kind, kw) in TINY_VARIANTS.items():
        path = tmp_path_factory.mktemp(f"tiny-bare-{name}")
        checkpoints[name] = (path, build_tiny_checkpoint(kind, path, tokenizer=False, **kw))
    return _with_refs(checkpoints)


@pytest.fixture
def engine_invariants():
    """After each test: every engine `new_llm` built that still exists (module-scoped ones
    included) is clean. Engines built during the test are dropped from the registry
    afterwards. Modules opt in with `pytestmark = pytest.mark.usefixtures(...)`."""
    first_new = len(_LIVE)  # module-scoped engines this test uses already exist
    yield
    try:
        for llm in _LIVE:
            assert_clean(llm)
    finally:
        del _LIVE[first_new:]
