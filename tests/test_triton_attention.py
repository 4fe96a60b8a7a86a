"""The "triton" attention backend, on the Triton interpreter where there is no GPU
(conftest sets TRITON_INTERPRET=1 before any kernel is built).

- Its kernel against dense causal attention over a scattered paged pool: mixed batches of
  prefills, cached-prefix extends, chunks and decodes, page sizes 1 and 16, GQA (groups
  of 2 and 3), MHA and one shared KV head, float32 / bfloat16 / float16, several decode
  splits, contexts of many key blocks, a head_dim that is not a power of two.
- That it reads only the slots of each request's context: every other slot of the pool
  (and the dummy page that pads the page table) holds NaN.
- The whole engine with it equals Hugging Face greedy output.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import HEAD_DIM, MIXED, Pool, run_step
from engine_checks import new_llm, tiny_batched_then_one_by_one

from kvray.attention import cpu_backend, create_attention_backend, resolve_backend_name, triton_ops
from kvray.attention.triton_backend import TritonAttentionBackend, decode_splits


def _tensors(lengths, q_heads, kv_heads, head_dim, dtype):
    q = [torch.randn(n, q_heads, head_dim, dtype=dtype) for n in lengths]
    k = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in lengths]
    v = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in lengths]
    return q, k, v


def _two_steps(backend, pool: Pool, cases, q_all, k_all, v_all) -> None:
    """Step 1 prefills every cached part; step 2 computes the rest of every request in a
    shuffled batch order. Both checked against the dense reference, on both layers."""
    for layer in range(2):
        step1 = [(r, 0, c) for r, (c, _) in enumerate(cases) if c]
        run_step(backend, pool, step1, q_all, k_all, v_all, layer)
        step2 = [(r, c, n) for r, (c, n) in enumerate(cases)]
        order = torch.randperm(len(step2)).tolist()
        run_step(backend, pool, [step2[i] for i in order], q_all, k_all, v_all, layer)


# (q heads, kv heads, dtype): GQA groups of 2 and 3, MHA, one shared KV head; every dtype.
HEADS_AND_DTYPES = [
    (4, 2, torch.float32),
    (4, 2, torch.bfloat16),
    (6, 2, torch.float32),
    (6, 2, torch.bfloat16),
    (2, 2, torch.bfloat16),
    (4, 1, torch.float16),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dtype"), HEADS_AND_DTYPES, ids=str)
def test_mixed_batch_matches_dense(page_size, q_heads, kv_heads, dtype) -> None:
    torch.manual_seed(page_size + 10 * q_heads + kv_heads)
    pool = Pool(page_size, kv_heads, dtype, seed=page_size)
    backend = create_attention_backend("triton", pool.cache, q_heads, HEAD_DIM, HEAD_DIM**-0.5)
    total = [c + n for c, n in MIXED]
    q_all, k_all, v_all = _tensors(total, q_heads, kv_heads, HEAD_DIM, dtype)
    for row, n in enumerate(total):
        pool.allocate(row, n)
    _two_steps(backend, pool, MIXED, q_all, k_all, v_all)


# Contexts of several 64-key blocks, extends of several 64-query blocks.
LONG = [
    (150, 80),  # extend after a long cached prefix: 2 query blocks, 4 key blocks
    (0, 130),  # a long fresh prefill
    (200, 1),  # decode over 4 key blocks
    (63, 1),  # decode at a block edge
    (64, 1),
    (1, 1),  # two keys: fewer than the splits
]


@pytest.mark.parametrize(("num_splits", "head_dim"), [(1, 64), (3, 24), (16, 64)])
def test_long_contexts_and_splits(num_splits: int, head_dim: int) -> None:
    """Split-K decode with 1, 3 and 16 splits (empty splits included) over contexts of
    several key blocks; head_dim 24 pads to 32 lanes."""
    torch.manual_seed(head_dim + num_splits)
    dtype = torch.bfloat16
    pool = Pool(16, 2, dtype, seed=head_dim, head_dim=head_dim, num_slots=2048, width=256)
    backend = TritonAttentionBackend(pool.cache, 4, head_dim, head_dim**-0.5, num_splits)
    total = [c + n for c, n in LONG]
    q_all, k_all, v_all = _tensors(total, 4, 2, head_dim, dtype)
    for row, n in enumerate(total):
        pool.allocate(row, n)
    _two_steps(backend, pool, LONG, q_all, k_all, v_all)


@pytest.mark.parametrize("page_size", [1, 16])
def test_reads_only_each_requests_context(page_size: int) -> None:
    """Every slot outside the requests' contexts, the dummy page and the unused tail of each
    last page included, holds NaN: one read of them would poison the output."""
    torch.manual_seed(7)
    dtype = torch.float32
    pool = Pool(page_size, 2, dtype, seed=3, num_slots=512)
    pool.cache._kv_buffer.fill_(float("nan"))
    backend = TritonAttentionBackend(pool.cache, 4, HEAD_DIM, HEAD_DIM**-0.5, num_splits=4)
    cases = [(0, 21), (9, 1), (40, 3), (70, 1)]
    total = [c + n for c, n in cases]
    q_all, k_all, v_all = _tensors(total, 4, 2, HEAD_DIM, dtype)
    for row, n in enumerate(total):
        pool.allocate(row, n)
    _two_steps(backend, pool, cases, q_all, k_all, v_all)


def test_backend_choice_and_guards(monkeypatch) -> None:
    pool = Pool(16, 2, torch.float32, seed=0)
    # A CPU pool: kvray's CPU kernels where they serve it (the AVX2 one takes head_dim 8),
    # else torch; never Triton.
    on_cpu = "cpu" if cpu_backend.supports(pool.cache, HEAD_DIM) else "torch"
    assert resolve_backend_name("auto", pool.cache, HEAD_DIM) == on_cpu
    # An H200 has 132 multiprocessors: a lone decode is cut into the most pieces, a batch
    # that fills the device into none.
    splits = [decode_splits(n, 8, 132) for n in (1, 2, 4, 16, 64, 256)]
    assert splits == sorted(splits, reverse=True)
    assert splits[0] == 16 and splits[-1] == 1
    monkeypatch.setattr(triton_ops, "_INTERPRETED", False)  # as if compiled for a GPU
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        create_attention_backend("triton", pool.cache, 4, HEAD_DIM, 1.0)


@pytest.mark.usefixtures("engine_invariants")
@pytest.mark.parametrize(
    ("variant", "page_size", "cache"),
    [("llama", 1, "radix"), ("qwen2", 16, "naive"), ("qwen3", 16, "radix")],
)
def test_engine_greedy_matches_hf(tiny, variant: str, page_size: int, cache: str) -> None:
    """The engine on the triton backend, prompts chunked 8 tokens a step and batched with
    decodes, then one at a time (a radix cache serves the prefixes): equal to HF."""
    path, refs = tiny[variant]
    llm = new_llm(
        path,
        page_size=page_size,
        cache_policy=cache,
        max_prefill_tokens=8,
        num_pages=512 // page_size,
        attention_backend="triton",
    )
    assert type(llm.engine.worker.attn) is TritonAttentionBackend
    tiny_batched_then_one_by_one(llm, refs, "triton")
