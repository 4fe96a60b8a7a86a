"""kvray: LLM serving on Ray with tensor parallelism and a paged, prefix-sharing KV cache."""

from kvray.core import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the engine pulls in torch and transformers: load on use
    if name == "LLM":
        from kvray.cluster.llm import LLM

        return LLM
    raise AttributeError(name)
