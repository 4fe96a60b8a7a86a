"""Random-weight checkpoints for benchmarks and tests (one home): tiny Llama / Qwen2 / Qwen3
models for the test suite, and any model shape from a config (a preset name or a
config.json), so a benchmark needs no weights to travel."""

from __future__ import annotations

import json
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


# Shapes of public checkpoints (their config.json facts, no weights).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny-llama": dict(model_type="llama", **TINY_COMMON, num_hidden_layers=2),
}


def random_model_config(spec: str) -> dict[str, Any]:
    """A model shape: a `PRESETS` name or the path of a config.json (with `model_type`)."""
    if spec in PRESETS:
        return dict(PRESETS[spec])
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    config = json.loads(path.read_text())
    if "model_type" not in config:
        raise ValueError(f"{path} has no model_type")
    return config


def write_random_checkpoint(
    path: str | Path, spec: str, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0
) -> Path:
    """Save a checkpoint of shape `spec` (see `random_model_config`) with random weights
    (transformers' own initialisation, drawn on `device`) in `dtype`, without a tokenizer.
    Returns `path`."""
    import torch
    import transformers as tf

    config = random_model_config(spec)
    hf_config = tf.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(path)
    return path
