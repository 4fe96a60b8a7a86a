"""The fused CPU ops (`kvray.models.fused`) against the torch expressions they replace, bit for
bit, in bfloat16 and float32, on the kernel path and on the torch fallback; and the model's
logits, which must not depend on which of the two paths ran."""

from __future__ import annotations

import pytest
import torch

from kvray.attention import AttnMetadata, create_attention_backend
from kvray.kvcache import create_kvcache_pool
from kvray.models import LlamaForCausalLM, ModelConfig, TPGroup, fused
from kvray.models.layers import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch) -> str:
    """Run the test on the C++ kernel, then on the torch fallback. The kernel run is skipped
    where no kernel serves the test's dtype (its `dtype` parameter, else bfloat16): the
    AVX2 build serves float32 only."""
    if request.param == "kernel":
        if not fused.available():
            pytest.skip("no fused CPU kernel here (no compiler or AVX2, or KVRAY_CPU_KERNELS=0)")
        dtype = (
            request.getfixturevalue("dtype") if "dtype" in request.fixturenames else torch.bfloat16
        )
        if dtype not in fused.kernel_dtypes():
            pytest.skip(f"the fused CPU kernel here does not serve {dtype}")
    else:
        monkeypatch.setattr(fused, "_mod", lambda: None)
    return request.param


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaNs in different places"
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[want.dtype]
    g = got.masked_fill(nan, 0).contiguous().view(bits)
    w = want.masked_fill(nan, 0).contiguous().view(bits)
    bad = g != w
    if bad.any():
        err = (got.float() - want.float())[bad].abs().max().item()
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} differ (max abs diff {err:.3g})")


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# Hidden sizes of real models (576: SmolLM2-135M, 4096: 7B), odd ones (a scalar tail), one
# below a vector (7), and enough rows to split over threads.
NORM_SHAPES = [(1, 576), (128, 576), (3, 17), (2, 7), (7, 4096), (129, 5000), (1, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(path: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = _randn(*shape, dtype=dtype, seed=1, scale=3.0)
    w = _randn(shape[-1], dtype=dtype, seed=2)
    assert_same(fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_over_heads_of_a_projection(path: str, dtype: torch.dtype, head_dim: int) -> None:
    """Qwen3's q/k norm: over head_dim of a [T, H, D] view into the qkv projection."""
    t, h = 5, 3
    qkv = _randn(t, (h + 2) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, : h * head_dim].reshape(t, h, head_dim)
    w = _randn(head_dim, dtype=dtype, seed=4)
    assert_same(fused.rms_norm(q, w, 1e-6), fused.rms_norm_reference(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm(path: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = _randn(*shape, dtype=dtype, seed=5)
    residual = _randn(*shape, dtype=dtype, seed=6, scale=4.0)
    w = _randn(shape[-1], dtype=dtype, seed=7)
    x0, residual0 = x.clone(), residual.clone()
    out, new_residual = fused.add_rms_norm(x, residual, w, 1e-5)
    assert_same(new_residual, x + residual)
    assert_same(out, fused.rms_norm_reference(x + residual, w, 1e-5))
    assert_same(x, x0)  # inputs are not written
    assert_same(residual, residual0)


# [T, I]: real intermediate sizes (1536: SmolLM2-135M), odd ones (ATen's scalar tail).
SILU_SHAPES = [(1, 64), (1, 100), (5, 1537), (128, 1536), (3, 4000), (2, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_mul(path: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    t, i = shape
    gate_up = _randn(t, 2 * i, dtype=dtype, seed=8, scale=4.0)
    assert_same(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up))


def test_silu_mul_every_bfloat16(path: str) -> None:
    """silu(gate) for all 65536 bfloat16 gates (NaN, inf and denormals included), times up
    values that make the second rounding matter."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = _randn(65536, dtype=torch.bfloat16, seed=9)
    gate_up = torch.cat([every.reshape(64, 1024), up.reshape(64, 1024)], dim=1)
    assert_same(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "h", "d"), [(1, 9, 64), (128, 9, 64), (5, 3, 128), (3, 1, 20)])
def test_rotary(path: str, dtype: torch.dtype, t: int, h: int, d: int) -> None:
    """q of a qkv projection, rotated by real rope angles; on the kernel path in place."""
    qkv = _randn(t, (h + 2) * d, dtype=dtype, seed=10)
    q = qkv[:, : h * d].reshape(t, h, d)
    positions = torch.arange(t) * 37 + 5
    cos, sin = RotaryEmbedding(d, 10000.0, None, "cpu").cos_sin(positions, dtype)
    want = fused.rotary_reference(q, cos, sin)
    rest = qkv[:, h * d :].clone()
    got = fused.rotary(q, cos, sin)
    assert_same(got, want)
    assert_same(qkv[:, h * d :], rest)  # k and v untouched
    if path == "kernel":
        assert got.data_ptr() == q.data_ptr()
    else:
        assert_same(q, qkv[:, : h * d].reshape(t, h, d))


def test_rotary_random_angles(path: str) -> None:
    """cos/sin not of the form (a, a): each half of cos and sin is read on its own."""
    x = _randn(4, 2, 64, dtype=torch.bfloat16, seed=11)
    cos = _randn(4, 64, dtype=torch.bfloat16, seed=12)
    sin = _randn(4, 64, dtype=torch.bfloat16, seed=13)
    want = fused.rotary_reference(x, cos, sin)
    assert_same(fused.rotary(x, cos, sin), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(path: str, dtype: torch.dtype) -> None:
    """Rounding where torch rounds holds for denormal results, infinities and NaNs too."""
    tiny = torch.tensor([1e-39, -3e-39, 5e-38, 1e-30], dtype=dtype)  # denormals
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    x = _randn(6, 64, dtype=dtype, seed=14)
    x[0, :4], x[1, :5], x[2] = tiny, specials, 1e-20  # row 2: squares underflow
    x[3, 7] = 1e30  # a huge element: the mean of squares overflows
    residual = _randn(6, 64, dtype=dtype, seed=15)
    w = _randn(64, dtype=dtype, seed=16)
    out, new_residual = fused.add_rms_norm(x, residual, w, 1e-6)
    assert_same(new_residual, x + residual)
    assert_same(out, fused.rms_norm_reference(x + residual, w, 1e-6))
    assert_same(fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6))

    cos = torch.full((6, 64), 1e-20, dtype=dtype)  # products are denormals
    sin = _randn(6, 64, dtype=dtype, seed=17) * 1e-19
    want = fused.rotary_reference(x.reshape(6, 1, 64), cos, sin)
    assert_same(fused.rotary(x.clone().reshape(6, 1, 64), cos, sin), want)

    # SiLU near SLEEF's exp bounds (0 below -104, inf above 100), of infinities and NaN, and
    # of values whose exp is a denormal
    edges = [-1e30, -104.5, -104.0, -103.9, -100.0, -88.0, -87.5, 88.7, 99.9, 100.0, 100.5]
    gate = torch.tensor([*edges, *specials.tolist()]).to(dtype)
    gate = torch.cat([gate, _randn(32 - gate.numel(), dtype=dtype, seed=18, scale=50.0)])
    gate_up = torch.cat([gate.reshape(1, 32), _randn(1, 32, dtype=dtype, seed=19)], dim=1)
    assert_same(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up))


def test_inputs_the_kernel_does_not_serve_fall_back() -> None:
    """float16, autograd, a strided last dim and an x with overlapping rows take the torch
    expression (and rotary then leaves x alone)."""
    x = _randn(4, 64, dtype=torch.float16, seed=18)
    w = _randn(64, dtype=torch.float16, seed=19)
    half = fused.rms_norm(x, w, 1e-6)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, fused.rms_norm_reference(x, w, 1e-6), rtol=0, atol=0)

    g = _randn(3, 64, dtype=torch.float32, seed=20).requires_grad_()
    out = fused.silu_mul(g)
    assert out.grad_fn is not None
    out.sum().backward()
    assert g.grad is not None

    cos = _randn(3, 64, dtype=torch.bfloat16, seed=21)
    sin = _randn(3, 64, dtype=torch.bfloat16, seed=22)
    strided = _randn(3, 64, 2, dtype=torch.bfloat16, seed=23).transpose(1, 2)  # stride(-1) 2
    expanded = _randn(3, 1, 64, dtype=torch.bfloat16, seed=24).expand(3, 4, 64)
    for x in (strided, expanded):
        before = x.clone()
        assert_same(fused.rotary(x, cos, sin), fused.rotary_reference(before, cos, sin))
        assert_same(x, before)


# -- the model: same logits on either path ----------------------------------------------------


def _tiny_model(arch: str, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(
        {
            "architectures": [arch],
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64 if arch == "Qwen3ForCausalLM" else 32,
            "num_hidden_layers": 2,
            "vocab_size": 97,
            "rms_norm_eps": 1e-6,
        }
    )
    model = LlamaForCausalLM(cfg, TPGroup(), dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def _prefill_then_decode(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Two requests prefill (9 and 5 tokens) in one batch, then both decode one token."""
    cfg, page_size, num_pages = model.config, 16, 4
    cache = create_kvcache_pool(
        num_kv_heads=cfg.num_kv_heads,
        num_layers=cfg.num_layers,
        head_dim=cfg.head_dim,
        num_pages=num_pages,
        page_size=page_size,
        dtype=model.dtype,
        device="cpu",
        tp_size=1,
    )
    attn = create_attention_backend(
        "auto", cache, model.num_q_heads_local, cfg.head_dim, model.attn_scale
    )
    table = torch.arange(num_pages * page_size, dtype=torch.int32).reshape(2, -1)
    logits = []
    for starts, ids in [([0, 0], [list(range(3, 12)), list(range(40, 45))]), ([9, 5], [[7], [8]])]:
        meta = AttnMetadata.build(
            table, [0, 1], starts, [len(i) for i in ids], num_pages * page_size
        )
        attn.prepare(meta)
        flat = torch.tensor([t for i in ids for t in i])
        logits.append(model(flat, meta.positions, attn, torch.arange(len(flat))))
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_logits_same_on_kernel_and_fallback(monkeypatch, arch: str, dtype) -> None:
    if dtype not in fused.kernel_dtypes():
        pytest.skip(f"no fused CPU kernel for {dtype} here")
    model = _tiny_model(arch, dtype)
    kernel = _prefill_then_decode(model)
    monkeypatch.setattr(fused, "_mod", lambda: None)
    for got, want in zip(kernel, _prefill_then_decode(model), strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 17, 16, 3, 1])
def test_argmax_rows(path: str, dtype: torch.dtype, vocab: int) -> None:
    """torch.argmax's answer row for row: ties to the lowest id (also +0 against -0), the
    first NaN wins, all -inf gives 0, a maximum in the scalar tail is found."""
    x = _randn(130, vocab, dtype=dtype, seed=7, scale=4.0)
    x[1] = x[1].max()  # every id ties
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, [vocab - 1, vocab // 3]] = float("nan")
    x[5] = -0.0
    x[5, vocab - 1] = 0.0
    x[6, vocab - 1] = 1e30
    x[7, :] = x[7].min()
    x[7, [vocab // 2, vocab - 1]] = 2.0
    rows = x[::2]  # a strided view of rows (contiguous within each row)
    for t in (x, rows):
        assert torch.equal(fused.argmax_rows(t), t.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 301, 33, 5])
def test_mask_rows_is_xgrammars_token_bitmask(dtype: torch.dtype, vocab: int) -> None:
    """The kernel's grammar masks equal xgrammar's own `apply_token_bitmask_inplace`:
    listed rows only, every kind of word (all allowed, none, mixed), the vocabulary's tail."""
    import xgrammar as xgr

    if not fused.available():
        pytest.skip("no fused CPU kernel here")
    words = (vocab + 31) // 32
    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none
    bitmask[3, ::2] = 0
    x = _randn(6, vocab, dtype=dtype, seed=3)
    want = x.clone()
    rows = [0, 1, 2, 3, 5]
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    assert fused.mask_rows_(x, bitmask, rows)
    assert torch.equal(x, want)


_STEPS_SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from kvray.workers.host_memory import keep_large_allocations
    assert keep_large_allocations()
def step(i):  # activations of an engine step: several MB each, a few alive at once
    live = []
    for mb in (6, 25, 12, 25, 3, 18):
        live.append(torch.empty((mb + i % 3) << 18, dtype=torch.float32).fill_(1.0))
        if len(live) > 2:
            live.pop(0)
for i in range(3):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):
    step(i)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_host_allocator_keeps_step_memory_mapped() -> None:
    """A worker's tuned malloc serves repeated steps' large activations from memory it
    already has, where glibc's defaults map and fault them in again (checked in fresh
    processes, since the tuning is process-wide)."""
    import subprocess
    import sys

    from kvray.workers import host_memory

    if not sys.platform.startswith("linux"):
        pytest.skip("tunes glibc malloc only")

    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _STEPS_SCRIPT, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())

    # Where address-space randomisation puts a mapping just past the heap, the tuned heap
    # must grow elsewhere once within the measured steps (one of four runs here, never with
    # randomisation off): the best of five runs is the allocator's own behaviour.
    default, tuned = faults("default"), min(faults("tuned") for _ in range(5))
    assert host_memory.keep_large_allocations()
    assert tuned * 10 < default, (tuned, default)


def test_tcmalloc_preload_env(monkeypatch) -> None:
    from kvray.workers import host_memory

    lib = "/opt/gperftools/libtcmalloc.so.4"
    env = {"KVRAY_TCMALLOC": lib}
    assert host_memory.preload_env(env) == {"LD_PRELOAD": lib}
    # after whatever is preloaded already; never twice
    assert host_memory.preload_env({**env, "LD_PRELOAD": "/x/libfoo.so"}) == {
        "LD_PRELOAD": f"{lib}:/x/libfoo.so"
    }
    assert host_memory.preload_env({**env, "LD_PRELOAD": lib}) == {}
    assert host_memory.preload_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) == {}
    assert host_memory.preload_env({"KVRAY_TCMALLOC": "0"}) == {}
    monkeypatch.setattr(host_memory, "_installed_tcmalloc", lambda: None)
    assert host_memory.preload_env({}) == {}  # none installed


_REEXEC_SCRIPT = """
import os, sys
from kvray.workers import host_memory
host_memory.reexec_with_tcmalloc()
maps = open("/proc/self/maps").read()
print(os.environ.get("LD_PRELOAD"), os.environ[host_memory.PRELOAD_BEFORE] == "", sys.argv[1:],
      os.path.basename(sys.argv[2]) in maps)
env = host_memory.env_without_added_preload(os.environ)
print("LD_PRELOAD" in env, host_memory.PRELOAD_BEFORE in env)
"""


def test_reexec_starts_the_same_command_with_the_library_preloaded() -> None:
    """The CLI's re-execution, with a stand-in library (any shared object this Python does
    not load by itself): the new process has it mapped, the same arguments, and children
    can be given the environment without it."""
    import ctypes.util
    import os
    import subprocess
    import sys

    name = ctypes.util.find_library("resolv")
    path = next(
        (
            os.path.join(d, name)
            for d in ("/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib/aarch64-linux-gnu")
            if name and os.path.exists(os.path.join(d, name))
        ),
        None,
    )
    if path is None or not sys.platform.startswith("linux"):
        pytest.skip("no stand-in shared library found")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"KVRAY_TCMALLOC": path}
    out = subprocess.run(
        [sys.executable, "-c", _REEXEC_SCRIPT, "--flag", path],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[0] == f"{path} True ['--flag', '{path}'] True"
    assert out[1] == "False False"
