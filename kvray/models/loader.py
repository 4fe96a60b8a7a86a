"""Load one TP shard of a Hugging Face checkpoint (config.json + safetensors).

Each rank reads only its own slices: safetensors' `get_slice` maps the file and copies just
the requested rows/columns. Every parameter part of the model must be filled exactly by the
checkpoint; anything missing is an error, never silently left uninitialised. Every tensor
loaded must have the full shape config.json implies and a floating-point dtype (a quantized
weight, int8 or FP8 with its scales elsewhere, is refused rather than read as numbers).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvray.models import fused
from kvray.models.config import ModelConfig
from kvray.models.layers import ColumnParallelLinear
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
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


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
        pickled = sorted(p.name for p in [*path.glob("*.bin"), *path.glob("*.pt")])
        found = (
            f" (found {', '.join(pickled[:3])}: pickled weights are not read)" if pickled else ""
        )
        raise FileNotFoundError(f"no *.safetensors weights in {path}{found}")
    return files


def _target(name: str, config: ModelConfig, names: set[str]) -> tuple[str, str, int] | None:
    """Checkpoint tensor name -> (our module path, parameter name, part), or None to skip
    (`names`: every tensor the checkpoint holds)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == _HEAD:
        if not config.tie_word_embeddings:
            return ("lm_head", "weight", 0)
        # A tied checkpoint may still carry a copy; the embedding is the one we use, unless
        # the head is all it saved (transformers loads that one too).
        return ("model.embed_tokens", "weight", 0) if _EMBED not in names else None
    m = _NAME.match(name)
    if m is None:
        return None
    module, proj, param = m["module"], m["proj"], m["param"]
    if proj in _MERGED:
        merged, part = _MERGED[proj]
        return f"{module}.{merged}", param, part
    return f"{module}.{proj}", param, 0


def _full_shapes(config: ModelConfig) -> dict[tuple[str, str, int], tuple[int, ...]]:
    """Every parameter part the model takes from the checkpoint (the same on every rank),
    with the unsharded shape of its checkpoint tensor: those of a one-rank model, built on
    the meta device (no memory)."""
    whole = LlamaForCausalLM(config, TPGroup(), torch.float32, "meta")
    shapes = {}
    for mod_name, mod in whole.named_modules():
        if hasattr(mod, "load_weight"):
            for param, tensor in mod.named_parameters(recurse=False):
                for part in range(getattr(mod, "num_parts", 1)):
                    shape = tuple(tensor.shape)
                    if isinstance(mod, ColumnParallelLinear):  # parts stacked on rows
                        shape = (mod.out_sizes[part], *shape[1:])
                    shapes[(mod_name, param, part)] = shape
    return shapes


def _check_tensor(name: str, src: Any, want: tuple[int, ...]) -> None:
    dtype, shape = src.get_dtype(), tuple(src.get_shape())
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"checkpoint tensor {name!r} is {dtype}: quantized checkpoints are not supported "
            "(use a float32, bfloat16 or float16 one)"
        )
    if shape != want:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {list(shape)}, but config.json implies "
            f"{list(want)}"
        )


def _read(files: list[Path], name: str) -> torch.Tensor:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def _untie_distinct_head(config: ModelConfig, files: list[Path], names: set[str]) -> ModelConfig:
    """A config that says tied, on a checkpoint whose LM head and embedding are both saved
    and differ, is untied: transformers then keeps the two apart (it ties only what it
    can without dropping a saved weight), and so must we to give its logits."""
    if not (config.tie_word_embeddings and _EMBED in names and _HEAD in names):
        return config
    if torch.equal(_read(files, _EMBED), _read(files, _HEAD)):
        return config
    return dataclasses.replace(config, tie_word_embeddings=False)


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
    files = weight_files(path)
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    config = _untie_distinct_head(ModelConfig.from_pretrained(path), files, names)
    model = LlamaForCausalLM(config, tp, dtype, device)
    shapes = _full_shapes(config)
    expected = shapes.keys()
    loaded: set[tuple[str, str, int]] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = _target(name, config, names)
                    if target is None:
                        continue
                    if target not in expected:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                    src = f.get_slice(name)
                    _check_tensor(name, src, shapes[target])
                    module, param, part = target
                    model.get_submodule(module).load_weight(param, src, part)
                    loaded.add(target)
    missing = expected - loaded
    if missing:
        shown = ", ".join(f"{m}.{p}[{i}]" for m, p, i in sorted(missing)[:5])
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {shown}")
    model.pack_weights(small_batch_kernel)
    if model.device.type == "cpu":
        fused.available()  # build the fused CPU ops now (once), not on the first request
    return model
