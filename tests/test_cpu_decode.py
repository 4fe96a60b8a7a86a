"""The C++ paged decode kernel against dense attention (where it can be built)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.attention import cpu_decode

pytestmark = pytest.mark.skipif(
    not cpu_decode.available(), reason="no AVX-512 CPU or no C++ toolchain for the kernel"
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
    ],
)
def test_paged_decode_matches_dense_attention(
    dtype, tol, batch, max_len, kv_heads, group, head_dim, page_size
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
    q = torch.randn(batch, kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim**-0.5

    got = cpu_decode.paged_decode(q, k_pool, v_pool, slots.contiguous(), lens, scale)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_slots_past_the_length_are_never_read(dtype):
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
    out = cpu_decode.paged_decode(q, k_pool, v_pool, slots, lens, 0.2)
    assert torch.isfinite(out).all()
