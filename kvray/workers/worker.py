"""ModelWorker: one TP rank's model shard, KV pool and attention backend, executing plans.

The worker mirrors the scheduler's page_table and token_pool. It applies each StepPlan's
deltas in the order the plan documents (freed rows, admissions, table writes, then the
batch's fill ids and out_loc), runs the model over the step's tokens, and samples. Every
rank computes the same sampled tokens (same logits after the all-gather, same seeds), and
writes them into its own token pool, so the next decode step needs no input ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvray.attention import create_attention_backend
from kvray.attention.base import AttnMetadata
from kvray.core import SamplingParams, StepPlan, StepResult, div_ceil
from kvray.kvcache import MHAKVCache, create_kvcache_pool
from kvray.models import TPGroup, load_model
from kvray.workers.sampler import sample_device


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself (plain data: it crosses process bounds)."""

    model_path: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu", "cuda", "cuda:N"
    num_pages: int  # schedulable pages; the pool adds the dummy page
    page_size: int
    max_running_reqs: int
    max_seq_len: int
    attention_backend: str = "auto"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def _host(a: np.ndarray) -> torch.Tensor:
    """int64 CPU tensor of a plan array (copied: plans arrive as read-only buffers)."""
    return torch.tensor(a, dtype=torch.int64)


def _flat_positions(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """For requests computing `lens[b]` positions from `starts[b]`: every position, flat."""
    total = int(lens.sum())
    first = torch.cumsum(lens, 0) - lens
    return torch.arange(total) - first.repeat_interleave(lens) + starts.repeat_interleave(lens)


class ModelWorker:
    def __init__(self, spec: WorkerSpec, tp: TPGroup) -> None:
        self.spec = spec
        self.tp = tp
        self.device = torch.device(spec.device)
        self.model = load_model(Path(spec.model_path), tp, spec.torch_dtype, self.device)
        cfg = self.model.config
        self.kvcache: MHAKVCache = create_kvcache_pool(
            num_kv_heads=cfg.num_kv_heads,
            num_layers=cfg.num_layers,
            head_dim=cfg.head_dim,
            num_pages=spec.num_pages,
            page_size=spec.page_size,
            dtype=spec.torch_dtype,
            device=self.device,
            tp_size=tp.size,
        )
        self.attn = create_attention_backend(
            spec.attention_backend,
            self.kvcache,
            self.model.num_q_heads_local,
            cfg.head_dim,
            self.model.attn_scale,
        )
        width = div_ceil(spec.max_seq_len, spec.page_size) * spec.page_size
        shape = (spec.max_running_reqs, width)
        self.page_table = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.token_pool = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.dummy_slot = spec.num_pages * spec.page_size  # first slot of the dummy page
        self._sampling: dict[int, tuple[SamplingParams, int]] = {}  # row -> (params, seed)

    @property
    def kv_buffer_shape(self) -> tuple[int, ...]:
        return self.kvcache.buffer_shape

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return _host(a).to(self.device)

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step. Returns the sampled tokens (every rank computes them; the
        caller keeps rank 0's), or None for a plan with nothing to compute."""
        for row in plan.freed_rows:
            self._sampling.pop(row, None)
        for adm in plan.admitted:
            self._sampling[adm.row] = (adm.sampling, adm.seed)
        for w in plan.table_writes:
            self.page_table[w.row, w.start : w.start + len(w.slots)] = self._tensor(w.slots)
        if plan.is_empty:
            return None

        rows, starts, lens = _host(plan.rows), _host(plan.starts), _host(plan.extend_lens)
        if plan.fill_ids.size:
            fill_lens = _host(plan.fill_lens)
            f_rows = rows.repeat_interleave(fill_lens).to(self.device)
            f_pos = _flat_positions(starts, fill_lens).to(self.device)
            self.token_pool[f_rows, f_pos] = self._tensor(plan.fill_ids)
        t_rows = rows.repeat_interleave(lens).to(self.device)
        positions = _flat_positions(starts, lens).to(self.device)
        self.page_table[t_rows, positions] = self._tensor(plan.out_loc)

        meta = AttnMetadata.build(
            self.page_table, rows.to(self.device), starts, lens, pad_slot=self.dummy_slot
        )
        input_ids = self.token_pool[t_rows, positions]
        sample_mask = torch.tensor(plan.sample, dtype=torch.bool)
        logits_indices = (meta.cu_seqlens_q[1:].long() - 1)[sample_mask.to(self.device)]
        self.attn.prepare(meta)
        logits = self.model(input_ids, positions, self.attn, logits_indices)
        if logits.shape[0] == 0:
            return StepResult(plan.step_id, np.zeros(0, dtype=np.int32))

        sampled_rows = plan.rows[plan.sample]
        next_pos = (plan.starts + plan.extend_lens)[plan.sample]
        params = [self._sampling[int(r)] for r in sampled_rows]
        top_k = max((p.logprobs or 0) for p, _ in params)
        out = sample_device(
            logits,
            [p for p, _ in params],
            [s for _, s in params],
            next_pos.tolist(),
            top_k,
            with_logprobs=any(p.logprobs is not None for p, _ in params),
        )
        self.token_pool[self._tensor(sampled_rows), self._tensor(next_pos)] = out.token_ids
        host = out.numpy()
        return StepResult(
            plan.step_id, host.token_ids, host.logprobs, host.top_ids, host.top_logprobs
        )
