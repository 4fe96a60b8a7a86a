"""Tiny random Llama / Qwen2 / Qwen3 checkpoints for benchmarks and tests (one home)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TINY_COMMON: dict[str, Any] = dict(
    vocab_size=301,  # not a multiple of the TP size: exercises vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 q heads per kv head
    max_position_embeddings=512,
    initializer_range=0.2,  # large weights: decisive logits, stable greedy paths
    eos_token_id=None,  # never stop early in Hugging Face generate
    bos_token_id=None,
    pad_token_id=0,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tiny_checkpoint(
    path: str | Path, kind: str = "llama", seed: int = 0, tokenizer: bool = False, **overrides: Any
) -> Any:
    """Save a tiny random `kind` ("llama" | "qwen2" | "qwen3") checkpoint (float32) into
    `path` and return the Hugging Face model (eval mode), for reference outputs.
    `overrides` change `TINY_COMMON` entries (layers, heads, tying, ...). With `tokenizer`,
    the embedded SmolLM2 tokenizer files are copied next to it (`kvray.LLM` loads one);
    ids below the tiny vocabulary decode as ordinary byte-level BPE tokens."""
    import torch
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY_COMMON, **overrides})).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer:
        from kvray.models.embedded import ensure_embedded_model

        src = ensure_embedded_model(progress=False)
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, path / name)
    return model
