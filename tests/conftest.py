"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os

import pytest

from kvray.bench.tiny import write_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
def tiny_checkpoints(tmp_path_factory) -> dict:
    """Every TINY_VARIANTS entry saved once per session (with a tokenizer):
    {name: (checkpoint dir, Hugging Face model)}."""
    out = {}
    for name, (kind, kw) in TINY_VARIANTS.items():
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (path, build_tiny_checkpoint(kind, path, **kw))
    return out
