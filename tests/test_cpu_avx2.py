"""The AVX2 paged attention kernel (every request of a step in one call) against dense
causal attention, where it can be built; and the "cpu" backend that runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_checks import scattered_requests

from kvray.attention import cpu_avx2, cpu_paged

pytestmark = pytest.mark.skipif(
    not cpu_avx2.available(), reason="no AVX2/FMA CPU or no C++ toolchain for the kernel"
)


def _reference(q, k_pool, v_pool, slots, context, scale):
    """Dense causal attention in float32 of `q` (the last len(q) positions of a context)."""
    total = len(slots)
    mask = torch.arange(total)[None, :] <= torch.arange(context, total)[:, None]
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k_pool[slots].float().transpose(0, 1)[None],
        v_pool[slots].float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "contexts,news,kv_heads,group,head_dim,page_size",
    [
        ([0], [1], 1, 1, 64, 16),  # one token alone
        ([44, 12, 300, 0], [1, 1, 1, 1], 3, 3, 64, 16),  # decodes: SmolLM2's heads
        ([37, 90, 5], [5, 5, 5], 3, 3, 64, 16),  # speculative steps checking 4 drafts
        ([0, 0, 0], [5, 16, 17], 3, 3, 64, 16),  # prompts at query-block edges
        ([0, 40, 300, 7], [77, 7, 33, 1], 2, 4, 64, 1),  # cached prefixes, a decode, page 1
        ([16, 0], [48, 300], 1, 8, 32, 4),
        ([0], [520], 3, 3, 64, 16),  # several key blocks and query blocks
        ([0, 20], [70, 45], 2, 2, 128, 16),
        ([9, 3], [40, 1], 1, 2, 256, 4),
        ([31, 0], [2, 33], 2, 5, 40, 16),  # a head_dim that is a multiple of 8, not of 16
        ([63], [3], 1, 16, 8, 16),  # the largest group, the smallest head
        # enough query blocks for a task to take several KV heads: as many as its rows allow
        ([0, 5], [200, 140], 2, 16, 32, 16),  # both heads, every row a task holds
        ([0], [150], 6, 8, 16, 16),  # half the heads (the largest divisor that fits)
    ],
)
def test_every_request_matches_dense_causal_attention(
    dtype, tol, contexts, news, kv_heads, group, head_dim, page_size
):
    q, k_pool, v_pool, slots, starts, requests = scattered_requests(
        contexts, news, kv_heads, group, head_dim, page_size, dtype, seed=sum(news) + head_dim
    )
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    assert cpu_avx2.paged_attend(q, k_pool, v_pool, requests, scale, out)
    for ctx, n, s, start in zip(contexts, news, slots, starts, strict=True):
        ref = _reference(q[start : start + n], k_pool, v_pool, s, ctx, scale)
        torch.testing.assert_close(out[start : start + n].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_slot_past_a_context_is_read_and_only_its_rows_are_written(dtype):
    q, k_pool, v_pool, slots, starts, requests = scattered_requests(
        [3, 0, 17], [30, 9, 1], 2, 2, 64, 16, dtype, seed=7
    )
    used = torch.zeros(k_pool.shape[0], dtype=torch.bool)
    used[torch.cat(slots)] = True
    k_pool[~used] = float("nan")  # the rest of each page, and every other page
    v_pool[~used] = float("nan")
    q_rows = torch.zeros(q.shape[0] + 2, *q.shape[1:], dtype=dtype)
    q_rows[1:-1] = q  # the rows around these requests belong to others
    shifted = cpu_paged.Extends(
        requests.slots, requests.k_start, requests.q_start + 1, requests.q_len
    )
    out = torch.full(q_rows.shape, float("nan"), dtype=dtype)
    assert cpu_avx2.paged_attend(q_rows, k_pool, v_pool, shifted, 0.125, out)
    assert torch.isfinite(out[1:-1]).all()
    assert out[0].isnan().all() and out[-1].isnan().all()


def test_what_it_cannot_serve_is_declined_not_computed():
    q, k_pool, v_pool, _, _, requests = scattered_requests(
        [4], [2], 1, 2, 64, 16, torch.float32, seed=1
    )
    out = torch.full(q.shape, 7.0)
    half = [t.to(torch.float16) for t in (q, k_pool, v_pool, out)]
    assert not cpu_avx2.paged_attend(*half[:3], requests, 0.125, half[3])
    assert not cpu_avx2.serves(torch.float16, 2, 1, 64)
    odd = torch.randn(2, 2, 12), torch.randn(k_pool.shape[0], 1, 12)
    assert not cpu_avx2.paged_attend(odd[0], odd[1], odd[1], requests, 0.125, torch.empty(2, 2, 12))
    assert not cpu_avx2.serves(torch.float32, 2, 1, 12)
    assert not cpu_avx2.serves(torch.float32, 17, 1, 64)
    assert (out == 7.0).all()
