"""Load one TP shard of a Hugging Face checkpoint (config.json + safetensors).

Each rank reads only its own slices: safetensors' `get_slice` maps the file and copies just
the requested rows/columns. Every parameter part of the model must be filled exactly by the
checkpoint; anything missing is an error, never silently left uninitialised.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvray.models import fused
from kvray.models.config import ModelConfig
from kvray.models.llama import LlamaForCausalLM
from kvray.models.tp import TPGroup

# Checkpoint tensors merged into one of our parameters: name -> (our module, part index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NAME = re.compile(r"^(?P<module>.+?)\.(?P<proj>[a-z_]+)\.(?P<param>weight|bias)$")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those named by the index if there is one,
    otherwise every `*.safetensors` in the directory."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _target(name: str, config: ModelConfig) -> tuple[str, str, int] | None:
    """Checkpoint tensor name -> (our module path, parameter name, part), or None to skip."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        # A tied checkpoint may still carry a copy; the embedding is the one we use.
        return None if config.tie_word_embeddings else ("lm_head", "weight", 0)
    m = _NAME.match(name)
    if m is None:
        return None
    module, proj, param = m["module"], m["proj"], m["param"]
    if proj in _MERGED:
        merged, part = _MERGED[proj]
        return f"{module}.{merged}", param, part
    return f"{module}.{proj}", param, 0


def _expected_parts(model: LlamaForCausalLM) -> set[tuple[str, str, int]]:
    expected = set()
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "load_weight"):
            for param, _ in mod.named_parameters(recurse=False):
                for part in range(getattr(mod, "num_parts", 1)):
                    expected.add((mod_name, param, part))
    return expected


def load_model(
    path: str | Path,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device | str,
    small_batch_kernel: bool | None = None,
) -> LlamaForCausalLM:
    """Build this rank's shard of the checkpoint at `path`, running in `dtype` on `device`
    (`small_batch_kernel`: see `LlamaForCausalLM.pack_weights`)."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    model = LlamaForCausalLM(config, tp, dtype, device)
    expected = _expected_parts(model)
    loaded: set[tuple[str, str, int]] = set()
    with torch.no_grad():
        for file in weight_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = _target(name, config)
                    if target is None:
                        continue
                    if target not in expected:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                    module, param, part = target
                    model.get_submodule(module).load_weight(param, f.get_slice(name), part)
                    loaded.add(target)
    missing = expected - loaded
    if missing:
        shown = ", ".join(f"{m}.{p}[{i}]" for m, p, i in sorted(missing)[:5])
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {shown}")
    model.pack_weights(small_batch_kernel)
    if model.device.type == "cpu":
        fused.available()  # build the fused CPU ops now (once), not on the first request
    return model
