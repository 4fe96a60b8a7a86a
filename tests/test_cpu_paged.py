"""The C++ paged attention kernels (decode, and prompts on AMX) against dense attention,
where they can be built and run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_checks import scattered_requests

from kvray.attention import cpu_paged

pytestmark = pytest.mark.skipif(
    not cpu_paged.available(), reason="no AVX-512 CPU or no C++ toolchain for the kernel"
)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "batch,max_len,kv_heads,group,head_dim,page_size",
    [
        (7, 45, 3, 3, 64, 16),
        (5, 37, 2, 2, 32, 1),
        (3, 130, 1, 4, 128, 4),
        (1, 1, 2, 1, 16, 16),
        # the bf16 fast path accumulates a few query heads at a time: groups that split
        (4, 33, 1, 8, 64, 16),
        (2, 17, 2, 5, 128, 1),
        (2, 19, 1, 3, 256, 4),
        (3, 2, 3, 1, 32, 1),
        # the tile engine: several 16-key blocks in place and a copied last one, more query
        # heads than one tile's 16 columns (per KV head, and across KV heads), page size 32
        (2, 300, 2, 20, 64, 16),
        (3, 200, 8, 4, 128, 16),
        (2, 77, 2, 7, 64, 32),
    ],
)
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-amx", "dot-products"])
def test_paged_decode_matches_dense_attention(
    dtype, tol, batch, max_len, kv_heads, group, head_dim, page_size, tiles
):
    torch.manual_seed(batch * 131 + max_len)
    pages_per_req = -(-max_len // page_size)
    num_pages = batch * pages_per_req + 3
    k_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, dtype=dtype)
    pages = torch.randperm(num_pages)[: batch * pages_per_req].view(batch, pages_per_req)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)[:, :max_len]
    lens = torch.randint(1, max_len + 1, (batch,))
    lens[0] = max_len
    # q as the model hands it over: a view of a wider projection (rows not contiguous)
    qkv = torch.randn(batch, (kv_heads * group + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : kv_heads * group * head_dim].view(batch, kv_heads * group, head_dim)
    scale = head_dim**-0.5

    got = cpu_paged.paged_decode(q, k_pool, v_pool, slots.contiguous(), lens, scale, tiles)

    mask = torch.arange(max_len)[None, :] < lens[:, None]
    ref = F.scaled_dot_product_attention(
        q[:, :, None, :].float(),
        k_pool[slots].float().transpose(1, 2),
        v_pool[slots].float().transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-amx", "dot-products"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_slots_past_the_length_are_never_read(dtype, tiles):
    # Entries past seq_len point at slots holding NaN: a read would poison the output.
    # Odd lengths too: the bf16 path pairs positions and must not pair in a padding slot.
    k_pool = torch.randn(64, 2, 32, dtype=dtype)
    v_pool = torch.randn(64, 2, 32, dtype=dtype)
    k_pool[32:] = float("nan")
    v_pool[32:] = float("nan")
    slots = torch.arange(64).view(2, 32).flip(0).contiguous()  # request 0 -> slots 32..63
    slots[0, :10] = torch.arange(10)
    lens = torch.tensor([9, 31])
    slots[1] = torch.arange(32)
    slots[1, 31] = 63  # the position right past request 1's odd length: a NaN slot
    q = torch.randn(2, 4, 32, dtype=dtype)
    out = cpu_paged.paged_decode(q, k_pool, v_pool, slots, lens, 0.2, tiles)
    assert torch.isfinite(out).all()


def _extend_inputs(contexts, news, kv_heads, group, head_dim, page_size, seed):
    return scattered_requests(
        contexts, news, kv_heads, group, head_dim, page_size, torch.bfloat16, seed
    )


def _extend_or_skip(q, k_pool, v_pool, extends, scale, tiles=True):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    if not cpu_paged.paged_extend(q, k_pool, v_pool, extends, scale, out, tiles):
        pytest.skip("no AVX-512 BF16 here: the prompt kernel declines")
    return out


@pytest.mark.parametrize(
    "contexts,news,kv_heads,group,head_dim,page_size",
    [
        ([0], [1], 1, 1, 64, 16),
        ([0, 0, 0], [5, 16, 17], 3, 3, 64, 16),  # SmolLM2's heads; block edges
        ([0, 40, 300], [77, 7, 33], 2, 4, 64, 1),  # cached prefixes, page size 1
        ([16, 0], [48, 300], 1, 8, 32, 4),
        ([0], [520], 3, 3, 64, 16),  # several key blocks and query blocks
        ([0, 20], [70, 45], 2, 2, 128, 16),  # output past four tiles: the rest in memory
        ([9], [40], 1, 2, 256, 4),
    ],
)
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-amx", "dot-products"])
def test_paged_extend_matches_dense_causal_attention(
    contexts, news, kv_heads, group, head_dim, page_size, tiles
):
    q, k_pool, v_pool, slots, starts, extends = _extend_inputs(
        contexts, news, kv_heads, group, head_dim, page_size, seed=sum(news)
    )
    scale = head_dim**-0.5
    out = _extend_or_skip(q, k_pool, v_pool, extends, scale, tiles)
    for ctx, n, s, start in zip(contexts, news, slots, starts, strict=True):
        total = ctx + n
        mask = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
        ref = F.scaled_dot_product_attention(
            q[start : start + n].float().transpose(0, 1)[None],
            k_pool[s].float().transpose(0, 1)[None],
            v_pool[s].float().transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        # bf16 inputs, float32 sums: as close as torch's own bf16 SDPA gets
        torch.testing.assert_close(out[start : start + n].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-amx", "dot-products"])
def test_paged_extend_reads_no_slot_past_a_context_and_writes_only_its_rows(tiles):
    q, k_pool, v_pool, slots, starts, extends = _extend_inputs(
        [3, 0], [30, 9], 2, 2, 64, 16, seed=7
    )
    used = torch.zeros(k_pool.shape[0], dtype=torch.bool)
    used[torch.cat(slots)] = True
    k_pool[~used] = float("nan")  # the rest of each page, and every other page
    v_pool[~used] = float("nan")
    q_rows = torch.zeros(q.shape[0] + 2, *q.shape[1:], dtype=q.dtype)
    q_rows[1:-1] = q  # the step's rows around the extends belong to others (decodes)
    shifted = cpu_paged.Extends(extends.slots, extends.k_start, extends.q_start + 1, extends.q_len)
    out = _extend_or_skip(q_rows, k_pool, v_pool, shifted, 0.125, tiles)
    assert torch.isfinite(out[1:-1]).all()
    assert out[0].isnan().all() and out[-1].isnan().all()
