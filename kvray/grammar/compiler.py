"""Grammar compilation: `StructuredOutputsParams` -> an xgrammar `CompiledGrammar` for one
vocabulary, cached by the params' `key` (kind, canonical text).

One `GrammarCompiler` per (tokenizer, vocabulary size) per process (`compiler_for`), so a
thousand requests with the same schema compile once per process: the front end compiles
to validate a request (a spec the backend refuses is a 400 naming the field), the workers
compile again in theirs, off the step loop (`prefetch` runs on a thread while the step's
forward pass runs; xgrammar releases the GIL while it compiles).

The vocabulary the grammar sees is the model's: ids past the tokenizer's (padding) and
special tokens are never allowed inside constrained text; stop tokens are given per
matcher (`Admission.stop_ids`), and end the output once the grammar is complete.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvray.core import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED = 512  # compiled grammars kept per compiler (least recently used go first)


class GrammarError(ValueError):
    """A structured-output spec the grammar backend cannot compile."""


class GrammarCompiler:
    """Compiles and caches grammars for one vocabulary. Thread safe: concurrent requests
    for one key wait on the same compilation."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_cached: int = MAX_CACHED) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = _tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self._pool: ThreadPoolExecutor | None = None
        self.on_compile: Callable[[float], None] | None = None  # seconds, per real compile

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (from the cache, or compiled now); GrammarError if the
        backend refuses the spec."""
        future, owner = self._claim(params)
        if owner:
            self._run(params, future)
        return future.result()

    def prefetch(self, params: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """Start compiling on a background thread (if not cached); the future's result is
        `compile(params)`'s."""
        future, owner = self._claim(params)
        if owner:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvray-grammar")
                pool = self._pool
            pool.submit(self._run, params, future)
        return future

    def _claim(
        self, params: StructuredOutputsParams
    ) -> tuple[Future[xgrammar.CompiledGrammar], bool]:
        """(the key's future, whether the caller must compile it)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future, False
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future, True

    def _run(self, params: StructuredOutputsParams, future: Future[Any]) -> None:
        start = time.perf_counter()
        try:
            grammar = self._build(*params.key)
        except Exception as e:  # noqa: BLE001 - every backend refusal becomes GrammarError
            future.set_exception(GrammarError(_first_line(e)))
            return
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - start)
        future.set_result(grammar)

    def _build(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        c = self._compiler
        if kind == "json":
            # No free whitespace: a small model would otherwise spend its tokens on it.
            return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(text))
            return c.compile_grammar(f"root ::= {alternatives}")
        if "::=" in text:  # EBNF (GBNF); otherwise Lark
            return c.compile_grammar(text)
        return c.compile_lark(text)


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _tokenizer_info(tokenizer: Any, vocab_size: int) -> xgrammar.TokenizerInfo:
    """The model's vocabulary as the grammar sees it: each id's bytes, special tokens
    emptied (so no grammar ever emits one as text), ids past the tokenizer's masked."""
    import xgrammar as xgr

    full = xgr.TokenizerInfo.from_huggingface(tokenizer)
    decoded = list(full.decoded_vocab)[:vocab_size]
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special |= set(tokenizer.all_special_ids)
    for i in special:
        if i < len(decoded):
            decoded[i] = b""
    return xgr.TokenizerInfo(decoded, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size)


@lru_cache(maxsize=8)
def compiler_for(model_path: str | Path, vocab_size: int) -> GrammarCompiler:
    """The process's compiler for a checkpoint's tokenizer at the model's vocabulary size.
    Raises GrammarError if the checkpoint has no tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except Exception as e:  # noqa: BLE001 - no tokenizer, no grammar
        raise GrammarError(f"structured outputs need the model's tokenizer: {e}") from None
    return GrammarCompiler(tokenizer, vocab_size)
