"""ModelWorker: one TP rank's model shard, KV pool and attention backend, executing plans.

The worker mirrors the scheduler's page_table and token_pool (`PlanMirror`), applies each
StepPlan to it, runs the model over the step's tokens, and samples. Every rank computes the
same sampled tokens (same logits after the all-gather, same seeds), and writes them into
its own token pool, so the next decode step needs no input ids.

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
from kvray.core import StepPlan, StepResult, table_width
from kvray.grammar import GrammarRows, compiler_for
from kvray.kvcache import MHAKVCache, create_kvcache_pool
from kvray.models import TPGroup, load_model
from kvray.workers.host_memory import keep_large_allocations
from kvray.workers.mirror import PlanMirror
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
        for adm in plan.admitted:
            self.grammar.admit(adm)
        batch = self.mirror.apply(plan)
        if batch is None:
            return None
        meta = AttnMetadata.build(
            self.mirror.page_table,
            batch.rows,
            plan.starts,
            plan.extend_lens,
            pad_slot=self.dummy_slot,
            positions=batch.positions,
        )
        sample_mask = torch.tensor(plan.sample, dtype=torch.bool)
        logits_indices = (meta.cu_seqlens_q[1:].long() - 1)[sample_mask.to(self.device)]
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
        out = sample_device(
            logits,
            [p for p, _ in params],
            [s for _, s in params],
            plan.sampled_positions.tolist(),
            top_k,
            with_logprobs=any(p.logprobs is not None for p, _ in params),
            token_bitmask=self.grammar.token_bitmask(sampled_rows),
        )
        self.mirror.record_sampled(plan, out.token_ids)
        host = out.numpy()
        self.grammar.advance(sampled_rows, host.token_ids.tolist())
        return StepResult(
            plan.step_id,
            host.token_ids,
            host.logprobs,
            host.top_ids,
            host.top_logprobs,
            compute_s=time.perf_counter() - start,
        )
