"""ModelWorker: one TP rank's model shard, KV pool and attention backend, executing plans.

The worker mirrors the scheduler's page_table and token_pool (`PlanMirror`), applies each
StepPlan to it, runs the model over the step's tokens, and samples. Every rank computes the
same sampled tokens (same logits after the all-gather, same seeds), and writes them into
its own token pool, so the next decode step needs no input ids.

A step with speculative drafts (`StepPlan.num_drafts`) samples at every position a
drafting request checks and keeps, per request, the samples up to the first that differs
from its draft (`_Checks`); the result then says how many tokens each request got.

A constrained request's grammar matcher lives here too, next to the sampler
(`kvray/grammar/matcher.py` says why): the worker masks its row's logits before sampling
and advances the matcher on the token it samples, so the matcher never lags, whatever the
scheduler's overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvray.attention import create_attention_backend
from kvray.attention.base import AttnMetadata
from kvray.config import EngineConfig
from kvray.core import StepPlan, StepResult, flat_positions, table_width
from kvray.grammar import GrammarRows, compiler_for
from kvray.kvcache import MHAKVCache, create_kvcache_pool
from kvray.models import TPGroup, load_model
from kvray.workers.host_memory import keep_large_allocations
from kvray.workers.mirror import PlanMirror
from kvray.workers.penalties import LogitProcessors
from kvray.workers.sampler import sample_device


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank builds itself from (plain data: it crosses process bounds): the engine's
    settings as declared, and the values resolved against the checkpoint and machine."""

    config: EngineConfig  # page_size, max_running_reqs, attention_backend, ...
    model_path: str
    dtype: str  # resolved: "float32" | "bfloat16" | "float16"
    device: str  # resolved: "cpu", "cuda", "cuda:N"
    num_pages: int  # schedulable pages; the pool adds the dummy page
    max_seq_len: int  # resolved

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


class ModelWorker:
    def __init__(self, spec: WorkerSpec, tp: TPGroup) -> None:
        self.spec = spec
        self.tp = tp
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":
            keep_large_allocations()
        self.model = load_model(
            Path(spec.model_path),
            tp,
            spec.torch_dtype,
            self.device,
            spec.config.small_batch_kernel,
        )
        cfg = self.model.config
        self.kvcache: MHAKVCache = create_kvcache_pool(
            num_kv_heads=cfg.num_kv_heads,
            num_layers=cfg.num_layers,
            head_dim=cfg.head_dim,
            num_pages=spec.num_pages,
            page_size=spec.config.page_size,
            dtype=spec.torch_dtype,
            device=self.device,
            tp_size=tp.size,
        )
        self.attn = create_attention_backend(
            spec.config.attention_backend,
            self.kvcache,
            self.model.num_q_heads_local,
            cfg.head_dim,
            self.model.attn_scale,
        )
        width = table_width(spec.max_seq_len, spec.config.page_size)
        self.mirror = PlanMirror(spec.config.max_running_reqs, width, self.device)
        self.dummy_slot = spec.num_pages * spec.config.page_size  # first slot of the dummy page
        # Constrained rows' grammar matchers, next to the sampler (kvray/grammar/matcher.py).
        self.grammar = GrammarRows(
            lambda: compiler_for(spec.model_path, cfg.vocab_size), spec.config.max_running_reqs
        )
        # Rows whose logits are processed (bias, min_tokens, penalties) before sampling.
        self.processors = LogitProcessors(cfg.vocab_size, self.device)

    @property
    def kv_buffer_shape(self) -> tuple[int, ...]:
        return self.kvcache.buffer_shape

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step. Returns the sampled tokens (every rank computes them; the
        caller keeps rank 0's), or None for a plan with nothing to compute.

        The result says how long the step took, timed here rather than by the engine:
        with steps overlapped (the engine submits plan N+1 before it waits for N), only the
        worker sees where one step's compute ends and the next one's begins. The clock
        stops once the tokens are on the host (a device sync), so it is the step's real
        compute time, not its launch time."""
        start = time.perf_counter()
        for row in plan.freed_rows:
            self.grammar.free(row)
            self.processors.free(row)
        for adm in plan.admitted:
            self.grammar.admit(adm)
            self.processors.admit(adm)
        batch = self.mirror.apply(plan)
        if batch is None:
            return None
        checks = _Checks.of(plan)
        rows, starts, lens = batch.rows, plan.starts, plan.extend_lens
        if checks is not None:
            # A drafting request's positions attend as that many decodes, each over the
            # keys up to itself: the same kernels and sums as decoding them one by one.
            split_rows, starts, lens = checks.as_decodes(plan)
            rows = torch.from_numpy(split_rows).to(self.device)
        meta = AttnMetadata.build(
            self.mirror.page_table,
            rows,
            starts,
            lens,
            pad_slot=self.dummy_slot,
            positions=batch.positions,
        )
        ends = (np.cumsum(plan.extend_lens, dtype=np.int64) - 1)[plan.sample]
        if checks is not None:  # every drafting request's position of each draft, too
            ends = np.repeat(ends, checks.counts) - checks.back
        logits_indices = torch.from_numpy(ends).to(self.device)
        self.attn.prepare(meta)
        logits = self.model(
            self.mirror.input_ids(batch), batch.positions, self.attn, logits_indices
        )
        if logits.shape[0] == 0:  # a prefill chunk that samples nothing
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # stop the clock when the step is done
            return StepResult(
                plan.step_id,
                np.zeros(0, dtype=np.int32),
                compute_s=time.perf_counter() - start,
            )

        params = self.mirror.sampling_of(plan)
        top_k = max((p.logprobs or 0) for p, _ in params)
        sampled_rows = plan.sampled_rows.tolist()
        positions = plan.sampled_positions.tolist()
        logit_rows = sampled_rows
        if checks is not None:  # one sample per checked position
            params = [p for p, n in zip(params, checks.counts, strict=True) for _ in range(n)]
            positions = checks.positions.tolist()
            logit_rows = checks.rows.tolist()
        bitmask = self.grammar.token_bitmask(logit_rows)
        with_logprobs = any(p.logprobs is not None for p, _ in params)
        raw = None  # the logits logprobs are read from, when processing changes `logits`
        if self.processors.processes(logit_rows):
            logits = logits.float()  # (the model's own output: changed in place)
            if with_logprobs:
                raw = logits.clone()
            self.processors.apply_(logits, logit_rows, bitmask)
        out = sample_device(
            logits,
            [p for p, _ in params],
            [s for _, s in params],
            positions,
            top_k,
            with_logprobs=with_logprobs,
            token_bitmask=bitmask,
            raw_logits=raw,
        )
        host = out.numpy()
        keep: np.ndarray | slice = slice(None)  # the samples the result keeps
        num_tokens: np.ndarray | None = None
        if checks is None:
            self.mirror.record_sampled(plan, out.token_ids)
            last_ids = host.token_ids
        else:
            drafts = self.mirror.tokens_at(checks.rows, checks.positions)
            keep, num_tokens = checks.accept(host.token_ids, drafts)
            self.mirror.record_tokens(
                checks.rows[keep], checks.positions[keep], host.token_ids[keep]
            )
            last_ids = host.token_ids[keep][np.cumsum(num_tokens) - 1]
        last = last_ids.tolist()
        self.grammar.advance(sampled_rows, last)
        self.processors.advance(sampled_rows, last)
        return StepResult(
            plan.step_id,
            host.token_ids[keep],
            None if host.logprobs is None else host.logprobs[keep],
            None if host.top_ids is None else host.top_ids[keep],
            None if host.top_logprobs is None else host.top_logprobs[keep],
            compute_s=time.perf_counter() - start,
            num_tokens=num_tokens,
        )


@dataclass(frozen=True)
class _Checks:
    """A step's speculative checks: each sampling request samples at its last `counts[i]`
    computed positions (its drafts + 1), `back` before the end of its span."""

    counts: np.ndarray  # int64 [S]
    rows: np.ndarray  # int64 [sum(counts)]: the row of each sample
    positions: np.ndarray  # int64 [sum(counts)]: where each sample goes in its row
    back: np.ndarray  # int64 [sum(counts)]: how far each sampled position is from the last

    @staticmethod
    def as_decodes(plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, starts, extend lens) of the plan's batch with each drafting request split
        into one single-token request per position it computes, in the same token order."""
        assert plan.num_drafts is not None
        split = np.where(plan.num_drafts > 0, plan.extend_lens, 1).astype(np.int64)
        within = flat_positions(np.zeros_like(split), split)  # 0, 1, ... within each part
        single = np.repeat(plan.num_drafts > 0, split)
        rows = np.repeat(plan.rows.astype(np.int64), split)
        starts = np.repeat(plan.starts.astype(np.int64), split) + within
        lens = np.where(single, 1, np.repeat(plan.extend_lens.astype(np.int64), split))
        return rows, starts, lens

    @staticmethod
    def of(plan: StepPlan) -> _Checks | None:
        drafts = plan.sampled_drafts
        if not drafts.any():
            return None
        counts = drafts + 1
        within = flat_positions(np.zeros_like(counts), counts)
        back = np.repeat(drafts, counts) - within
        rows = np.repeat(plan.sampled_rows.astype(np.int64), counts)
        positions = np.repeat(plan.sampled_positions.astype(np.int64), counts) - back
        return _Checks(counts, rows, positions, back)

    def accept(self, sampled: np.ndarray, drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the samples kept, as indices into `sampled`; how many each request keeps).
        `drafts[j]` is the token at sample j's position, the draft it checks (after a
        request's last draft there is none): a request keeps its samples up to and
        including the first that differs."""
        miss = sampled != drafts
        miss[self.back == 0] = True  # a request's last sample checks no draft
        keep = np.zeros(len(sampled), dtype=np.int64)
        num_tokens = np.zeros(len(self.counts), dtype=np.int32)
        off = n_keep = 0
        for i, c in enumerate(self.counts.tolist()):
            a = int(np.argmax(miss[off : off + c]))  # the last sample always misses
            keep[n_keep : n_keep + a + 1] = np.arange(off, off + a + 1)
            num_tokens[i] = a + 1
            n_keep += a + 1
            off += c
        return keep[:n_keep], num_tokens
