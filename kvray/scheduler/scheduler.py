"""Scheduler: decides, each step, WHO computes WHICH tokens into WHICH slots.

`step()` builds a StepPlan; `process_result()` takes the sampled tokens back. Both may be
called in the overlapped order plan N, plan N+1, result N, ...: a request's next decode
is planned before its previous token is known (the workers hold it), so every decision
here depends on lengths only, never on the values of in-flight tokens. A result also
carries how long its step took, which the prefill budget (`budget.py`) learns from.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvray import histogram
from kvray.config import SchedulerConfig
from kvray.core import (
    Admission,
    FinishReason,
    Req,
    ReqStatus,
    RequestRejected,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenEvent,
    check_prompt,
    div_ceil,
    flat_positions,
)
from kvray.kvcache import create_prefix_cache
from kvray.scheduler.budget import PrefillBudget
from kvray.scheduler.cache import CacheManager
from kvray.scheduler.ngram import NgramIndex
from kvray.scheduler.prefill import PrefillAdder
from kvray.scheduler.table import TableManager

_ADMIT_LOOKAHEAD = 64  # waiting requests one step may pass over (deferred or pending)


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _admission(req: Req) -> Admission:
    """A row's admission. A constrained request, or one whose logits are processed, also
    carries its stop tokens and the tokens it has output so far (none on first admission;
    all of them after a retraction or a replay, which is only re-admitted once no token of
    it is in flight), so the worker's grammar matcher and penalties resume exactly where
    the request is; with a repetition penalty, its prompt too."""
    sp = req.sampling
    if sp.structured_outputs is None and not sp.processes_logits:
        return Admission(req.table_idx, req.rid, sp, req.seed)
    return Admission(
        req.table_idx,
        req.rid,
        sp,
        req.seed,
        stop_ids=tuple(sorted(req.stop_ids)),
        output_ids=tuple(req.output_ids),
        prompt_ids=tuple(req.input_ids[: req.prompt_len]) if sp.repetition_penalty != 1 else (),
    )


# The bounds of the per-step histograms (`SchedulerStats`): vLLM's for tokens per step; step
# times from a small batch's decode on a GPU to a long prefill chunk on a CPU.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 10)


@dataclass
class SchedulerStats:
    """Monotonic counters (tokens unless named otherwise)."""

    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed
    decode_tokens: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found cached
    draft_tokens: int = 0  # speculative decoding: draft tokens checked...
    accepted_draft_tokens: int = 0  # ...and of those, kept (each one a step saved)
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    # Per step (as vLLM's iteration_tokens_total): the tokens it computed (decodes, drafts
    # checked, prompt tokens) and the workers' time computing it, as histograms
    # (`kvray.histogram`: cumulative counts per bound, then +Inf, and the sum).
    step_tokens_sum: int = 0
    step_tokens_buckets: list[int] = field(
        default_factory=lambda: histogram.empty_buckets(STEP_TOKEN_BUCKETS)
    )
    step_compute_seconds_sum: float = 0.0
    step_compute_seconds_buckets: list[int] = field(
        default_factory=lambda: histogram.empty_buckets(STEP_SECONDS_BUCKETS)
    )

    def observe_step(self, tokens: int, compute_s: float | None) -> None:
        self.step_tokens_sum += tokens
        histogram.observe(self.step_tokens_buckets, STEP_TOKEN_BUCKETS, tokens)
        if compute_s is not None:
            self.step_compute_seconds_sum += compute_s
            histogram.observe(self.step_compute_seconds_buckets, STEP_SECONDS_BUCKETS, compute_s)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int] = (),
        seed: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.max_seq_len = config.effective_max_seq_len
        self.vocab_size = vocab_size  # prompt token ids must be below it (None: unchecked)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.table = TableManager(config.max_running_reqs, self.max_seq_len, config.page_size)
        self.cache = CacheManager(
            config.num_pages,
            config.page_size,
            self.table,
            create_prefix_cache(config.cache_policy, config.page_size),
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order: the newest is retracted first
        self.reqs: dict[int, Req] = {}
        self._inflight: dict[int, list[Req]] = {}  # step_id -> requests sampled by it
        self._shapes: dict[int, tuple[int, int]] = {}  # step_id -> (decodes, prefill tokens)
        self.budget = PrefillBudget(config)
        self._ngrams: dict[int, NgramIndex] = {}  # drafting requests' n-gram indexes
        self._next_step_id = 0
        self.stats = SchedulerStats()
        self._seeds = random.Random(seed)

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, rid: int, input_ids: Sequence[int], sampling: SamplingParams) -> Req:
        """Queue a request, or raise RequestRejected if it can never be served."""
        if rid in self.reqs:
            raise RequestRejected(f"request id {rid} is already in use", "rid")
        check_prompt(input_ids, sampling.max_tokens, self.max_seq_len, self.vocab_size)
        if sampling.n != 1:
            raise RequestRejected(
                f"n is {sampling.n}: an engine request is one choice (the offline LLM and "
                "the server run one request per choice)",
                "n",
            )
        if sampling.max_tokens is None:  # up to the rest of the context
            room = self.max_seq_len - len(input_ids)
            if sampling.min_tokens > room:
                raise RequestRejected(
                    f"min_tokens is {sampling.min_tokens}, but only {room} tokens fit after "
                    f"this prompt (max_seq_len {self.max_seq_len})",
                    "min_tokens",
                )
            sampling = dataclasses.replace(sampling, max_tokens=room)
        self._check_stop_ids(sampling.stop_token_ids)
        self._check_token_ids(dict(sampling.logit_bias or ()), "logit_bias")
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop |= self.eos_token_ids
        if sampling.structured_outputs is not None and not stop:
            raise RequestRejected(
                "a constrained request needs a token that ends it once its grammar is "
                "complete: this model has no EOS token (or ignore_eos is set) and no "
                "stop_token_ids were given",
                "stop_token_ids",
            )
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        req = Req(
            rid=rid,
            input_ids=list(input_ids),
            sampling=sampling,
            stop_ids=frozenset(stop),
            seed=seed,
        )
        self.reqs[rid] = req
        self.waiting.append(req)
        return req

    def _check_stop_ids(self, stop_ids: Sequence[int]) -> None:
        """Stop token ids are token ids of this model: one outside its vocabulary could
        never be sampled (and a grammar matcher refuses it outright)."""
        self._check_token_ids(stop_ids, "stop_token_ids")

    def _check_token_ids(self, ids: Iterable[int], field: str) -> None:
        if self.vocab_size is None:
            return
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise RequestRejected(
                    f"{field}: token id {t} is not in this model's vocabulary "
                    f"[0, {self.vocab_size})",
                    field,
                )

    def readmit(self, req: Req) -> None:
        """Queue a request carried over from another scheduler (the workers were rebuilt
        and every K/V is gone): it keeps its tokens, prompt length, budget and seed, and
        recomputes its K/V from scratch."""
        req.table_idx = -1
        req.cached_len = req.device_len = 0
        req.cache_handle = None
        req.pending = req.drafted = 0  # (the step they were for is lost)
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def live_requests(self) -> list[Req]:
        """Every unfinished request: running ones in admission order, then the queue."""
        return [*self.running, *self.waiting]

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> TokenEvent | None:
        """End a request wherever it is (cancelled, or a stop string the front end saw);
        its pages go back at once. None if it is unknown or already finished."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        self._finish(req, reason)
        if reason is FinishReason.ABORT:
            self.stats.num_aborted += 1
        return TokenEvent(
            rid,
            None,
            finish_reason=reason,
            num_cached_tokens=req.num_cached_prompt,
            queue_time_s=req.queue_time_s,
        )

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inflight)

    @property
    def num_decoding(self) -> int:
        """Running requests that decode a token next step (at most: a retraction may drop
        some, so the prefill budget computed from this errs on the short side)."""
        return sum(1 for r in self.running if not r.prefilling and r.device_len < r.max_device_len)

    @property
    def num_startable(self) -> int:
        """Waiting requests the next step could start: no more than the table has rows for
        (what the prefill budget's queue floor counts)."""
        return min(len(self.waiting), self.table.available_rows)

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> StepPlan | None:
        """Plan the next forward step, or None when there is nothing to compute."""
        ps = self.page_size
        decoding = self.num_decoding
        adder = PrefillAdder(
            self.cache,
            self.table,
            self.budget.tokens(decoding, self.num_startable),
            even_chunks=decoding > 0,
        )
        batch: list[tuple[Req, int, bool]] = []  # (request, tokens, is_prefill)
        drafts: dict[int, list[int]] = {}  # drafting request -> its draft tokens
        speculative = self.config.speculative_tokens > 0
        retracted = False

        # 1. Running requests, oldest first: one decode token each, or the next prefill
        #    chunk. When pages run out, retract the newest until the older ones fit.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.prefilling:
                chunk = adder.chunk_for(req)
                if chunk == 0 and adder.token_budget > 0 and self.running[-1] is not req:
                    self._retract(self.running[-1])
                    retracted = True
                    continue
                if chunk > 0:
                    adder.take(req, chunk)
                    batch.append((req, chunk, True))
            elif req.drafted and req.pending:
                pass  # its drafts' outcome (and so its length) is still in flight
            elif req.device_len < req.max_device_len:
                if req.cached_len % ps == 0:  # its next token opens a new page
                    if adder.pages_left < 1:
                        while adder.pages_left < 1 and self.running[-1] is not req:
                            self._retract(self.running[-1])
                        retracted = True
                        if adder.pages_left < 1:
                            self._retract(req)  # the newest left, and it cannot grow
                            continue
                    adder.committed_pages += 1
                tokens = 1
                if speculative:
                    # Drafts take only pages that no later running request needs for its
                    # next token: a draft never makes another request retract.
                    draft = self._draft(req, adder.pages_left - (len(self.running) - i - 1))
                    if draft:
                        adder.committed_pages += self._draft_pages(req, len(draft))
                        drafts[req.rid] = draft
                        tokens += len(draft)
                batch.append((req, tokens, False))
            i += 1

        # 2. Admit waiting requests in order (retracted ones first), unless this step just
        #    had to retract: admitting now would only thrash. A request whose prompt shares
        #    more with a request still prefilling than the cache holds yet waits for that
        #    prefill to be registered instead of computing the same K/V a second time.
        admitted: list[Admission] = []
        if not retracted:
            adder.reserved_pages = sum(1 for r in self.running if not r.prefilling)
            prefilling = [r for r in self.running if r.prefilling]
            deferred: list[Req] = []
            while self.waiting and len(deferred) < _ADMIT_LOOKAHEAD:
                req = self.waiting.popleft()
                if req.pending or self._defer_for_shared_prefix(req, prefilling):
                    deferred.append(req)
                    continue
                chunk = adder.try_admit(req)
                if chunk == 0:
                    self.waiting.appendleft(req)
                    break
                self.running.append(req)
                prefilling.append(req)
                admitted.append(_admission(req))
                if req.first_scheduled_time is None:  # first admission (not a re-admission)
                    req.first_scheduled_time = time.monotonic()
                    req.num_cached_prompt = min(req.cached_len, req.prompt_len)
                    self.stats.prefix_query_tokens += req.prompt_len
                    self.stats.prefix_hit_tokens += req.num_cached_prompt
                adder.take(req, chunk)
                batch.append((req, chunk, True))
            self.waiting.extendleft(reversed(deferred))

        # 3. A step that computes prompt tokens checks no drafts: every running stream's
        #    next token and the prompt's first one wait for the whole step, the longest
        #    there is, and drafts would only add rows to it (the pages they were counted
        #    for stay free).
        if drafts and any(is_prefill for _, _, is_prefill in batch):
            drafts = {}
            batch = [(r, n if p else 1, p) for r, n, p in batch]

        if not batch:
            return None
        return self._build_plan(batch, admitted, drafts)

    def _draft(self, req: Req, pages_left: int) -> list[int]:
        """Draft tokens for a decoding request to check this step (speculative decoding):
        greedy requests only, whose every token is known (none in flight), as many as
        leave room for one more token within max_tokens and fit in the free pages."""
        k = self.config.speculative_tokens
        sp = req.sampling
        if (
            req.pending
            or not sp.greedy
            or sp.logprobs is not None
            or sp.structured_outputs is not None
            or sp.processes_logits
        ):
            return []
        k = min(k, req.draft_limit or k, req.max_device_len - req.device_len - 1)
        if k <= 0:
            return []
        index = self._ngrams.get(req.rid)
        if index is None:
            index = self._ngrams[req.rid] = NgramIndex(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max
            )
        draft = index.draft(req.input_ids, k)
        while draft and self._draft_pages(req, len(draft)) > pages_left:
            draft.pop()
        return draft

    def _draft_pages(self, req: Req, num_drafts: int) -> int:
        """New pages a decoding request's drafts need beyond its next token's position."""
        ps = self.page_size
        return div_ceil(req.device_len + num_drafts, ps) - div_ceil(req.device_len, ps)

    def _build_plan(
        self,
        batch: list[tuple[Req, int, bool]],
        admitted: list[Admission],
        drafts: dict[int, list[int]],
    ) -> StepPlan:
        reqs = [r for r, _, _ in batch]
        for req, n, _ in batch:
            req.device_len = req.cached_len + n
        self.cache.allocate_paged(reqs)
        # Drain the journal now: what cache_req journals below re-points rows at cached
        # copies of K/V this very step is still computing, so it must reach the workers
        # after this step's out_loc writes, i.e. with the next plan.
        writes, freed = self.table.drain()

        rows = np.array([r.table_idx for r in reqs], dtype=np.int32)
        starts = np.array([r.cached_len for r in reqs], dtype=np.int32)
        ext = np.array([n for _, n, _ in batch], dtype=np.int32)
        out_loc = self.table.page_table[np.repeat(rows, ext), flat_positions(starts, ext)]

        sample = np.zeros(len(reqs), dtype=np.bool_)
        fill_lens = np.zeros(len(reqs), dtype=np.int32)
        num_drafts = np.zeros(len(reqs), dtype=np.int32)
        fills: list[np.ndarray] = []
        sampled: list[Req] = []
        token_pool = self.table.token_pool
        for j, (req, n, is_prefill) in enumerate(batch):
            if is_prefill:
                s = req.cached_len
                ids = np.asarray(req.input_ids[s : s + n], dtype=np.int32)
                token_pool[req.table_idx, s : s + n] = ids
                fills.append(ids)
                fill_lens[j] = n
                self.stats.prefill_tokens += n
                req.num_computed_prefill += n
                if req.device_len == len(req.input_ids):
                    req.complete_one()
                    sample[j] = True
                else:
                    req.cached_len = req.device_len
                # Register the full pages this chunk computes, so requests admitted from
                # the next step on can share them.
                self.cache.cache_req(req, finished=False)
            else:
                draft = drafts.get(req.rid) if drafts else None
                if draft:
                    # Its last token (the workers hold it) and the drafts after it.
                    s = req.cached_len
                    ids = np.asarray([req.input_ids[s], *draft], dtype=np.int32)
                    token_pool[req.table_idx, s : s + n] = ids
                    fills.append(ids)
                    fill_lens[j] = n
                    num_drafts[j] = len(draft)
                    self.stats.draft_tokens += len(draft)
                req.drafted = n - 1
                req.complete_one()
                sample[j] = True
                self.stats.decode_tokens += 1
            if sample[j]:
                req.pending += 1
                sampled.append(req)

        step_id = self._next_step_id
        self._next_step_id += 1
        self.stats.steps += 1
        # A drafting decode's fill is its last token and its drafts; a prompt chunk's, itself.
        drafting = int(np.count_nonzero(num_drafts))
        num_prefills = int(np.count_nonzero(fill_lens)) - drafting
        # The cost model counts checked drafts as prompt tokens: both are extra rows.
        extra = int(fill_lens.sum()) - drafting
        self._shapes[step_id] = (len(batch) - num_prefills, extra)
        if sampled:
            self._inflight[step_id] = sampled
        return StepPlan(
            step_id=step_id,
            rows=rows,
            starts=starts,
            extend_lens=ext,
            out_loc=out_loc,
            fill_ids=np.concatenate(fills) if fills else np.zeros(0, dtype=np.int32),
            fill_lens=fill_lens,
            sample=sample,
            table_writes=writes,
            admitted=tuple(admitted),
            freed_rows=freed,
            num_drafts=num_drafts if num_drafts.any() else None,
        )

    def process_result(self, result: StepResult) -> list[TokenEvent]:
        """Take the tokens a plan sampled; finish requests that hit a stop condition."""
        reqs = self._inflight.pop(result.step_id, [])
        shape = self._shapes.pop(result.step_id, None)
        if shape is not None:
            self.stats.observe_step(sum(shape), result.compute_s)
            if result.compute_s is not None:
                self.budget.observe(*shape, result.compute_s)
        events: list[TokenEvent] = []
        token_ids = result.token_ids.tolist()
        if result.logprobs is not None:
            logprobs = result.logprobs.tolist()
        else:
            logprobs = [None] * len(token_ids)
        tops = None
        if result.top_ids is not None and result.top_logprobs is not None:
            tops = [
                tuple(zip(i, lp, strict=True))
                for i, lp in zip(result.top_ids.tolist(), result.top_logprobs.tolist(), strict=True)
            ]
        token_pool = self.table.token_pool
        finished = ReqStatus.FINISHED
        counts = [1] * len(reqs) if result.num_tokens is None else result.num_tokens.tolist()
        end = 0
        for req, count in zip(reqs, counts, strict=True):
            req.pending -= 1
            start, end = end, end + count
            drafted, req.drafted = req.drafted, 0
            if req.status is finished:
                continue  # aborted or finished while this step was in flight
            if drafted:
                self._settle_drafts(req, drafted, count - 1)
            for i in range(start, end):
                tok = token_ids[i]
                ids = req.input_ids
                ids.append(tok)
                if req.table_idx >= 0:
                    token_pool[req.table_idx, len(ids) - 1] = tok
                # A batch computes logprobs for every row once any row asks: keep only what
                # this request asked for, so its output never depends on its batch mates.
                lp = top = None
                if req.sampling.logprobs is not None:
                    lp = logprobs[i]
                    if lp is not None:
                        req.output_logprobs.append(lp)
                    if tops is not None and req.sampling.logprobs > 0:
                        top = tops[i][: req.sampling.logprobs]
                        req.output_top_logprobs.append(top)
                reason = None
                if tok in req.stop_ids:
                    reason = FinishReason.STOP
                elif len(ids) >= req.max_device_len:
                    reason = FinishReason.LENGTH
                if reason is None:
                    events.append(TokenEvent(req.rid, tok, lp, top))
                    continue
                self._finish(req, reason)
                events.append(
                    TokenEvent(
                        req.rid,
                        tok,
                        lp,
                        top,
                        reason,
                        num_cached_tokens=req.num_cached_prompt,
                        queue_time_s=req.queue_time_s,
                    )
                )
                break  # (tokens kept past a stop are dropped)
        return events

    def _settle_drafts(self, req: Req, drafted: int, accepted: int) -> None:
        """A drafting step's outcome: positions of rejected drafts no longer count as
        computed, and pages that only they used go back to the free list."""
        self.stats.accepted_draft_tokens += accepted
        # The next draft: one longer after a draft that held whole, one past what held
        # after one that missed (checked drafts that miss are rows computed for nothing).
        if accepted == drafted:
            req.draft_limit = drafted + 1
        else:
            req.draft_limit = accepted + 1
        rejected = drafted - accepted
        if rejected == 0 or req.status is not ReqStatus.RUNNING:
            return  # (a retracted request holds no pages; it recomputes what it keeps)
        self.cache.shrink(req, req.cached_len - rejected)
        req.cached_len -= rejected
        req.device_len -= rejected

    def _defer_for_shared_prefix(self, req: Req, prefilling: list[Req]) -> bool:
        """Would `req` match a longer cached prefix once some prefilling request has
        registered its prompt? (Only a prefix-sharing cache can make waiting pay.)"""
        prefix_cache = self.cache.prefix_cache
        ps = self.page_size
        ids = req.input_ids
        limit = (len(ids) - 1) // ps * ps  # what match_req could ever match
        if not prefix_cache.shares_prefixes or limit == 0:
            return False
        head = ids[:ps]
        sharers = [r for r in prefilling if r.input_ids[:ps] == head]
        if not sharers:
            return False
        matched = prefix_cache.match_prefix(ids[:limit]).cached_len
        return any(
            _common_prefix_len(ids, r.input_ids, limit) // ps * ps >= matched + ps for r in sharers
        )

    # -- leaving the running set --------------------------------------------------------------

    def _release(self, req: Req) -> None:
        """Give back a running request's row and pages; its computed prefix stays cached."""
        self.cache.cache_req(req, finished=True)
        self.table.free(req.table_idx)
        req.table_idx = -1
        self.running.remove(req)

    def _retract(self, req: Req) -> None:
        """Preempt: back to the front of the queue. Re-admission re-matches the prefix it
        registered, so it recomputes only the unaligned tail."""
        self._release(req)
        req.cached_len = req.device_len = 0
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.status is ReqStatus.RUNNING:
            self._release(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        del self.reqs[req.rid]
        self._ngrams.pop(req.rid, None)
        self.stats.num_finished += 1

    # -- invariants ---------------------------------------------------------------------------

    def flush_cache(self) -> None:
        self.cache.flush()

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.running)
        rows = [r.table_idx for r in self.running]
        free_rows = self.table.free_rows
        assert len(set(rows)) == len(rows), "a page_table row is used twice"
        assert not set(rows) & set(free_rows), "a running request's row is on the free list"
        assert len(rows) + len(free_rows) == self.table.max_running_reqs, "a row leaked"
        for req in self.waiting:
            assert req.table_idx == -1 and req.cache_handle is None, "waiting request holds state"
        if not self.running and not self.cache.leases:
            info = self.cache.prefix_cache.size_info
            assert info.protected_size == 0, "a prefix is locked with nothing running"

    def is_idle_and_empty(self) -> bool:
        """No request left and, after flush_cache, every page free."""
        return not self.has_work and self.cache.num_free_pages == self.config.num_pages
