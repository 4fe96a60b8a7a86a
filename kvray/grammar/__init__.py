"""Structured outputs: grammars compiled once per spec (`compiler.py`) and the per-row
grammar matchers a worker keeps next to its sampler (`matcher.py`). Below `workers` in the
rooms: it knows `core` only, and xgrammar, imported when the first grammar is needed."""

from kvray.grammar.compiler import GrammarCompiler, GrammarError, compiler_for
from kvray.grammar.matcher import GrammarRows, TokenBitmask

__all__ = ["GrammarCompiler", "GrammarError", "GrammarRows", "TokenBitmask", "compiler_for"]
