"""Pure torch model code: TP-aware layers, the Llama family, weight loading."""

from __future__ import annotations

from kvray.models.config import ModelConfig, RopeScaling
from kvray.models.llama import LlamaForCausalLM
from kvray.models.loader import load_model
from kvray.models.tp import TPGroup

__all__ = ["LlamaForCausalLM", "ModelConfig", "RopeScaling", "TPGroup", "load_model"]
