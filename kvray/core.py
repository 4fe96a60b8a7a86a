"""The nouns every room shares: SamplingParams, Req, StepPlan, StepResult.

The scheduler produces a `StepPlan`, every TP worker consumes the same one, and rank 0
answers with a `StepResult`. Those two dataclasses are the whole contract between the
scheduling side (CPU only) and the compute side (model, attention, KV pool).
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvray.kvcache.base import BaseCacheHandle


def div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def table_width(max_seq_len: int, page_size: int) -> int:
    """Positions per page_table / token_pool row: whole pages covering max_seq_len."""
    return div_ceil(max_seq_len, page_size) * page_size


def flat_positions(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Every position of requests that compute `lens[i]` positions from `starts[i]`,
    concatenated in request order (int64)."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    first = np.cumsum(lens) - lens
    positions: np.ndarray = (
        np.arange(int(lens.sum()), dtype=np.int64)
        - np.repeat(first, lens)
        + np.repeat(starts, lens)
    )
    return positions


GrammarKind = str  # "json" | "regex" | "choice" | "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained request's output must match: exactly one of a JSON Schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular
    expression, one of a list of strings (`choice`), or a grammar (EBNF as xgrammar reads
    it, or Lark). vLLM's names and meanings.

    `key` is what a compiled grammar is cached under: the kind and one canonical text, so
    equal schemas written with different spacing compile once (key order is kept: the
    output's properties follow the schema's order)."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else dict(self.json)
            if not isinstance(schema, dict):
                raise ValueError("a JSON Schema must be an object")
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if self.choice is not None:
            choices = tuple(self.choice)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choices)

    @property
    def key(self) -> tuple[GrammarKind, str]:
        if self.json is not None:
            assert isinstance(self.json, str)
            return ("json", self.json)
        if self.json_object:
            return ("json", '{"type": "object"}')
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        assert self.grammar is not None
        return ("grammar", self.grammar)


MAX_LOGPROBS = 20  # top alternatives a token may come with (vLLM's default max_logprobs)


def _integer(name: str, value: object) -> int:
    """`value` as an int (a Python or numpy integer), else a ValueError naming `name`."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the rest of the context (as in vLLM)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # also return this many top alternatives per token
    # Text out (the front end's; the engine sees token ids only), as vLLM's fields: keep the
    # stop string, or the stop token's text, that ended the request; show special tokens.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrain the output to a grammar (None: free text). A constrained request ends on
    # one of its stop tokens once the grammar is complete.
    structured_outputs: StructuredOutputsParams | None = None
    # Logit processing before any choice, greedy's too (vLLM's order and meanings): add
    # `logit_bias` (token id -> bias, as OpenAI's); hold back the stop tokens (EOS and
    # stop_token_ids) until `min_tokens` are out; divide a positive logit (multiply a
    # negative one) by `repetition_penalty` for every token in the prompt or the output;
    # subtract `frequency_penalty` x its count and `presence_penalty` once for every token
    # in the output.
    # (Given as a mapping; kept as (token id, bias) pairs in id order, so params hash.)
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Choices per prompt: the offline LLM and the server run n requests (a seeded one's
    # choice i with seed + i); one engine request is one choice (n 1).
    n: int = 1

    def __post_init__(self) -> None:
        # Types first, each named (a wrong one would otherwise fail deep in a step, or pass
        # as something else: max_tokens=2.5). Integers may be numpy's; bools are not numbers.
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        # None as vLLM's callers write it: no limit, no stops.
        for name, unset in (("top_k", -1), ("stop", ()), ("stop_token_ids", ())):
            if getattr(self, name) is None:
                object.__setattr__(self, name, unset)
        for name in ("top_k", "max_tokens", "seed", "logprobs", "min_tokens", "n"):
            value = getattr(self, name)
            if value is not None or name in ("top_k", "min_tokens", "n"):
                object.__setattr__(self, name, _integer(name, value))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        # Accept lists from callers while keeping the dataclass hashable and frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        ids = tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether its logits are changed before the choice (bias, min_tokens, penalties):
        the worker then needs its prompt and output tokens (`Admission`)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )


_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...] | None:
    """A logit_bias as (token id, bias) pairs in id order (None when empty), each checked."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
        key, value = item
        if isinstance(key, str):
            key = int(key) if key.strip().lstrip("-").isdigit() else key
        token = _integer("logit_bias token id", key)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"logit_bias[{token}] must be a number, got {value!r}")
        bias = float(value)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        out[token] = bias
    return tuple(sorted(out.items())) or None


class RequestRejected(ValueError):
    """A request that can never be served as asked (e.g. it can never fit); `param` names
    the offending field, for the API's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[RequestRejected], tuple[str, str | None]]:
        return (type(self), (str(self), self.param))  # keeps `param` across processes


def check_prompt(
    input_ids: Sequence[int], max_tokens: int | None, max_seq_len: int, vocab_size: int | None
) -> None:
    """The check of a prompt against an engine's limits (the scheduler's, on every
    request; the server also runs it on a request of several choices before submitting
    any, so that none is taken and then withdrawn): token ids in the vocabulary, and
    prompt + max_tokens within the longest sequence the engine holds."""
    n, limit = len(input_ids), max_seq_len
    if n == 0:
        raise RequestRejected("the prompt is empty", "prompt")
    if vocab_size is not None:
        for t in input_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise RequestRejected(
                    f"token id {t!r} is not in this model's vocabulary [0, {vocab_size})",
                    "prompt",
                )
    where = (
        f"this engine's maximum sequence length of {limit} tokens (the smaller of the "
        "model context and the KV pool)"
    )
    if n >= limit:
        raise RequestRejected(
            f"the prompt has {n} tokens, which leaves no room to generate within {where}; "
            "shorten the prompt",
            "prompt",
        )
    if max_tokens is not None and n + max_tokens > limit:
        raise RequestRejected(
            f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
            f"exceeds {where}; shorten the prompt or lower max_tokens",
            "max_tokens",
        )


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or retracted); holds no row, no page, no lock
    RUNNING = "running"  # holds a page_table row, private pages and a locked prefix handle
    FINISHED = "finished"  # done; holds nothing


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or (set by the front end) a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(eq=False)
class Req:
    """One request's progress through the KV cache (scheduler-side state).

    `input_ids` is every token known so far: the prompt, then each sampled token as it comes
    back. Positions `[0, cached_len)` have K/V in the pool (or will, once the step that was
    planned for them has run); `[cached_len, device_len)` is what the current step computes.
    """

    rid: int
    input_ids: list[int]
    sampling: SamplingParams
    prompt_len: int = -1
    table_idx: int = -1
    cached_len: int = 0
    device_len: int = 0
    cache_handle: BaseCacheHandle | None = None
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    pending: int = 0  # sampled tokens planned but not yet returned (overlap scheduling)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    num_computed_prefill: int = 0  # prompt tokens this request actually computed (not cached)
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at admission
    drafted: int = 0  # draft tokens its step in flight checks (speculative decoding)
    draft_limit: int = 0  # most draft tokens its next step may check (0: the engine's)
    stop_ids: frozenset[int] = frozenset()  # token ids that end this request (EOS + stop ids)
    seed: int = 0  # the sampler's seed: sampling.seed, or one the engine drew for it
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.input_ids)
        assert self.sampling.max_tokens is not None  # the scheduler resolved a None
        self.max_device_len = self.prompt_len + self.sampling.max_tokens

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def output_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]

    @property
    def prefilling(self) -> bool:
        """Between steps, a prefilling request has no position reserved (device_len ==
        cached_len); a decoding one has exactly one, for the token it sampled last."""
        return self.device_len == self.cached_len

    def complete_one(self) -> None:
        """The step that computes [cached_len, device_len) is planned: those positions now
        count as cached, and one more position is reserved for the token it samples."""
        self.cached_len = self.device_len
        self.device_len += 1


@dataclass(frozen=True)
class TableWrite:
    """page_table[row, start : start + len(slots)] = slots (a matched prefix, or a
    duplicate region re-pointed to the prefix cache's copy)."""

    row: int
    start: int
    slots: np.ndarray


@dataclass(frozen=True)
class Admission:
    """A row that starts serving a request this step, with what the sampler needs."""

    row: int
    rid: int
    sampling: SamplingParams
    seed: int  # fixed per request, so every rank (and a replay) draws the same tokens
    # Constrained requests (`sampling.structured_outputs`) and those whose logits are
    # processed (`sampling.processes_logits`) only: the tokens that end the request (the
    # grammar's, or those min_tokens holds back), and the tokens it has already output,
    # which a re-admitted (retracted or replayed) request's grammar matcher re-advances
    # over before it masks and its penalties count. `prompt_ids` only with a
    # repetition_penalty (which counts the prompt's tokens too).
    stop_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """What one forward step computes, as a delta against the workers' mirrors.

    Batch order is the order of `rows`. Request i computes positions
    `starts[i] : starts[i] + extend_lens[i]`; its K/V goes to the matching span of
    `out_loc` (which the worker also writes into its page_table mirror). Token ids the
    worker does not hold yet arrive in `fill_ids` (`fill_lens[i]` of them for request i,
    written to token_pool[row, starts[i]:]); a decode step sends none, because the worker
    wrote the previous sampled token into its token pool itself. Requests with
    `sample[i]` produce one token, written to token_pool[row, starts[i] + extend_lens[i]].

    Speculative decoding: a greedy decode with `num_drafts[i]` = d > 0 computes its last
    token and d draft tokens after it (all d + 1 in `fill_ids`), and samples at each of
    the d + 1 positions. It keeps the samples up to and including the first that differs
    from the draft token it checks (or all d + 1): a + 1 tokens, the a drafts that held and
    one more, which goes to token_pool[row, starts[i] + 1 + a]. Positions past that hold
    K/V of rejected drafts, which later steps overwrite.

    Workers apply, in this order: `freed_rows`, `admitted`, `table_writes`, then the batch.
    """

    step_id: int
    rows: np.ndarray  # int32 [B]
    starts: np.ndarray  # int32 [B]
    extend_lens: np.ndarray  # int32 [B]
    out_loc: np.ndarray  # int32 [sum(extend_lens)]
    fill_ids: np.ndarray  # int32 [sum(fill_lens)]
    fill_lens: np.ndarray  # int32 [B]
    sample: np.ndarray  # bool [B]
    table_writes: tuple[TableWrite, ...] = ()
    admitted: tuple[Admission, ...] = ()
    freed_rows: tuple[int, ...] = ()
    num_drafts: np.ndarray | None = None  # int32 [B]; None: no drafts in this step

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_loc.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.sample.sum())

    @property
    def is_empty(self) -> bool:
        return self.batch_size == 0

    def spans(self, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, position) of every position the batch covers when request i covers
        `lens[i]` positions from `starts[i]`: `extend_lens` gives the computed tokens (the
        order of out_loc), `fill_lens` where `fill_ids` go. int64."""
        return np.repeat(self.rows.astype(np.int64), lens), flat_positions(self.starts, lens)

    @property
    def sampled_rows(self) -> np.ndarray:
        """The rows that sample a token this step, in batch order."""
        rows: np.ndarray = self.rows[self.sample]
        return rows

    @property
    def sampled_positions(self) -> np.ndarray:
        """Where each sampled token goes in its row (the position after the last computed;
        for a drafting request, after its last draft: where it goes if all drafts hold)."""
        ends: np.ndarray = (self.starts + self.extend_lens)[self.sample]
        return ends

    @property
    def sampled_drafts(self) -> np.ndarray:
        """Draft tokens each sampling request checks, in batch order (int64)."""
        if self.num_drafts is None:
            return np.zeros(self.num_samples, dtype=np.int64)
        drafts: np.ndarray = self.num_drafts[self.sample].astype(np.int64)
        return drafts


@dataclass(frozen=True)
class TokenEvent:
    """What the scheduler tells its caller after a step: a request produced a token
    and/or finished. `token_id` is None for a finish without a new token (abort)."""

    rid: int
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when the engine ended the request because it failed
    num_cached_tokens: int | None = None  # on the finishing event: prompt tokens from cache
    queue_time_s: float | None = None  # on the finishing event: arrival to first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def ended_on_stop_token(event: TokenEvent) -> bool:
    """The request ended on a stop token (EOS or one of its stop_token_ids): the engine
    finishes with `stop` and a token for no other reason (a stop string's finish is an
    abort, without one). Like vLLM, that token's text is not output unless
    include_stop_str_in_output."""
    return event.finish_reason is FinishReason.STOP and event.token_id is not None


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer to a plan: the tokens of each request with sample=True, in batch
    order; one each, unless the plan had drafts (then `num_tokens` says how many)."""

    step_id: int
    token_ids: np.ndarray  # int32 [sum(num_tokens)]
    logprobs: np.ndarray | None = None  # float32 [sum(num_tokens)]
    top_ids: np.ndarray | None = None  # int32 [sum(num_tokens), k]
    top_logprobs: np.ndarray | None = None  # float32 [sum(num_tokens), k]
    # Rank 0's wall time for the step, plan in to tokens on the host: the scheduler's
    # step-cost model learns from it (None: not measured).
    compute_s: float | None = None
    num_tokens: np.ndarray | None = None  # int32 [num_samples]; None: one each
