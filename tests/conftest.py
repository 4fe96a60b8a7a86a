"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- tiny random checkpoints (shared by end-to-end tests) -----------------------------------

TINY_COMMON = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 q heads per kv head
    max_position_embeddings=512,
    initializer_range=0.2,  # large weights: decisive logits, stable greedy paths
    eos_token_id=None,  # never stop early in HF generate
    bos_token_id=None,
    pad_token_id=0,
)
TINY_VARIANTS = {
    # kind, extra config: GQA with tied embeddings; qkv bias with an untied LM head;
    # q/k RMSNorm with a head_dim that is not hidden / heads.
    "llama": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_tiny_checkpoint(kind: str, path, seed: int = 0, tokenizer: bool = True, **kw):
    """Save a tiny random `kind` ("llama" | "qwen2" | "qwen3") checkpoint (float32) into
    `path` and return the Hugging Face model (eval mode) for reference outputs.

    With `tokenizer`, the embedded SmolLM2 tokenizer files are copied next to it, so the
    directory loads as a whole model (`kvray.LLM` needs a tokenizer); ids below the tiny
    vocabulary decode as ordinary byte-level BPE tokens."""
    import shutil
    from pathlib import Path

    import torch
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY_COMMON, **kw})).eval()
    path = Path(path)
    model.save_pretrained(path)
    if tokenizer:
        from kvray.models.embedded import ensure_embedded_model

        src = ensure_embedded_model(progress=False)
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, path / name)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """Every TINY_VARIANTS entry saved once per session (with a tokenizer):
    {name: (checkpoint dir, Hugging Face model)}."""
    out = {}
    for name, (kind, kw) in TINY_VARIANTS.items():
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (path, build_tiny_checkpoint(kind, path, **kw))
    return out
