"""The torch attention backend against dense causal attention, over a scattered paged pool."""

from __future__ import annotations

import pytest
import torch
from attention_checks import HEAD_DIM, MIXED, Pool, run_step

from kvray.attention import (
    ATTENTION_BACKENDS,
    AttnMetadata,
    backend_names,
    cpu_avx2,
    cpu_paged,
    create_attention_backend,
    resolve_backend_name,
)
from kvray.attention.cpu_backend import Avx2AttentionBackend, CpuAttentionBackend

CPU_KERNEL = cpu_paged.available()  # the AVX-512 kernels
# The AVX2 kernel serves the "cpu" backend where the AVX-512 kernels do not build.
AVX2_BACKEND = not CPU_KERNEL and cpu_avx2.available()


@pytest.mark.parametrize(
    ("backend_name", "head_dim"),
    [
        ("torch", HEAD_DIM),
        pytest.param(
            "cpu", 16, marks=pytest.mark.skipif(not CPU_KERNEL, reason="no AVX-512 kernel")
        ),
        pytest.param(
            "cpu", 40, marks=pytest.mark.skipif(not AVX2_BACKEND, reason="not the AVX2 kernel")
        ),
    ],
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (2, 2), (4, 1)])
def test_mixed_batch_matches_dense(
    page_size: int, q_heads: int, kv_heads: int, backend_name: str, head_dim: int
) -> None:
    torch.manual_seed(page_size * 10 + q_heads + kv_heads)
    dtype = torch.float32
    pool = Pool(page_size, kv_heads, dtype, seed=page_size, head_dim=head_dim)
    backend = create_attention_backend(backend_name, pool.cache, q_heads, head_dim, head_dim**-0.5)
    if backend_name == "cpu":
        assert isinstance(backend, CpuAttentionBackend if CPU_KERNEL else Avx2AttentionBackend)
    total = [c + n for c, n in MIXED]
    q_all = [torch.randn(n, q_heads, head_dim, dtype=dtype) for n in total]
    k_all = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in total]
    v_all = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in total]
    for row, n in enumerate(total):
        pool.allocate(row, n)
    for layer in range(2):  # layers share slots but not storage
        # Step 1 writes (and checks) every cached prefix as one prefill batch ...
        run_step(
            backend,
            pool,
            [(r, 0, c) for r, (c, _) in enumerate(MIXED) if c],
            q_all,
            k_all,
            v_all,
            layer,
        )
        # ... step 2 computes the rest of every request, in a shuffled batch order.
        step2 = [(r, c, n) for r, (c, n) in enumerate(MIXED)]
        order = torch.randperm(len(step2)).tolist()
        run_step(backend, pool, [step2[i] for i in order], q_all, k_all, v_all, layer)


@pytest.mark.skipif(not CPU_KERNEL, reason="no AVX-512 kernel")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("declines", [False, True], ids=["as_is", "kernel_declines"])
def test_cpu_backend_mixed_bfloat16_batch_with_the_prompt_kernel(
    page_size: int, head_dim: int, declines: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts, prompt chunks after cached prefixes and decodes in one bf16 step: the
    prompts go to the prompt kernel where it runs (the backend keeps using it: it never
    declined), else to SDPA; every row matches dense attention either way. With the
    kernel made to decline (as it does without AVX-512 BF16), SDPA takes over mid-step."""
    if declines:
        monkeypatch.setattr(cpu_paged, "paged_extend", lambda *args: False)
    torch.manual_seed(page_size + head_dim)
    pool = Pool(page_size, 2, torch.bfloat16, seed=page_size, head_dim=head_dim)
    backend = create_attention_backend("cpu", pool.cache, 6, head_dim, head_dim**-0.5)
    total = [c + n for c, n in MIXED]
    q_all = [torch.randn(n, 6, head_dim, dtype=torch.bfloat16) for n in total]
    k_all = [torch.randn(n, 2, head_dim, dtype=torch.bfloat16) for n in total]
    v_all = [torch.randn(n, 2, head_dim, dtype=torch.bfloat16) for n in total]
    for row, n in enumerate(total):
        pool.allocate(row, n)
    run_step(
        backend, pool, [(r, 0, c) for r, (c, _) in enumerate(MIXED) if c], q_all, k_all, v_all, 0
    )
    run_step(backend, pool, [(r, c, n) for r, (c, n) in enumerate(MIXED)], q_all, k_all, v_all, 0)
    probe = torch.zeros(1, 6, head_dim, dtype=torch.bfloat16)
    extends = cpu_paged.Extends(*(torch.zeros(n, dtype=torch.int64) for n in (1, 2, 1, 1)))
    runs = cpu_paged.paged_extend(
        probe, pool.cache.k_flat(0), pool.cache.v_flat(0), extends, 1.0, probe
    )
    assert backend._extend_kernel == runs


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_by_token_decode_bfloat16(page_size: int) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    pool = Pool(page_size, 2, dtype, seed=1)
    backend = create_attention_backend("auto", pool.cache, 4, HEAD_DIM, HEAD_DIM**-0.5)
    lengths = [20, 3]
    q_all = [torch.randn(n, 4, HEAD_DIM, dtype=dtype) for n in lengths]
    k_all = [torch.randn(n, 2, HEAD_DIM, dtype=dtype) for n in lengths]
    v_all = [torch.randn(n, 2, HEAD_DIM, dtype=dtype) for n in lengths]
    for row, n in enumerate(lengths):
        pool.allocate(row, n)
    run_step(backend, pool, [(0, 0, 10), (1, 0, 2)], q_all, k_all, v_all, 0)
    run_step(backend, pool, [(0, 10, 1), (1, 2, 1)], q_all, k_all, v_all, 0)
    for pos in range(11, 20):
        run_step(backend, pool, [(0, pos, 1)], q_all, k_all, v_all, 0)


def test_metadata_build() -> None:
    pool = Pool(4, 2, torch.float32, seed=3)
    pool.allocate(2, 6)
    pool.allocate(5, 3)
    meta = AttnMetadata.build(pool.table, [5, 2], [1, 4], [2, 2], pad_slot=pool.dummy_slot)
    assert meta.positions.tolist() == [1, 2, 4, 5]
    assert meta.out_loc.tolist() == pool.table[[5, 5, 2, 2], [1, 2, 4, 5]].tolist()
    assert meta.seq_lens_q.tolist() == [2, 2]
    assert meta.seq_lens_k.tolist() == [3, 6]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 4]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (2, 6)
    assert meta.page_table.shape == (2, 6) and meta.page_table.dtype == torch.int64
    assert meta.page_table[0, 3:].tolist() == [pool.dummy_slot] * 3  # masked padding
    assert meta.page_table[1].tolist() == pool.table[2, :6].tolist()
    with pytest.raises(ValueError):
        AttnMetadata.build(pool.table, [2], [0], [0])


def test_registry_and_auto() -> None:
    pool = Pool(16, 2, torch.float32, seed=0)
    assert set(ATTENTION_BACKENDS.names()) == {"cpu", "torch", "flash_attn", "triton"}
    assert backend_names()[0] == "auto"
    # A CPU pool: the C++ kernels where they serve the head size, else plain torch (the
    # AVX-512 ones take multiples of 16, the AVX2 one multiples of 8 up to 256).
    assert resolve_backend_name("auto", pool.cache, 8) == ("cpu" if AVX2_BACKEND else "torch")
    assert resolve_backend_name("auto", pool.cache, 12) == "torch"
    assert resolve_backend_name("auto", pool.cache, 64) == (
        "cpu" if CPU_KERNEL or AVX2_BACKEND else "torch"
    )
    with pytest.raises(ValueError, match="multiple of 16"):
        create_attention_backend("cpu", pool.cache, 4, 12, 1.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", pool.cache, 4, HEAD_DIM, 1.0)
    # No flash-attn here, and page_size 16 would be refused anyway.
    with pytest.raises((ImportError, ValueError)):
        create_attention_backend("flash_attn", pool.cache, 4, HEAD_DIM, 1.0)
    backend = create_attention_backend("torch", pool.cache, 4, HEAD_DIM, 1.0)
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(
            torch.zeros(1, 4, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), 0
        )
