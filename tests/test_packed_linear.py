"""oneDNN-packed bf16 linear weights give exactly what `F.linear` gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.models import packed

pytestmark = pytest.mark.skipif(
    not packed.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)),
    reason="packing off (KVRAY_CPU_KERNELS=0) or no oneDNN bf16 support here",
)


SHAPES = [((960, 576), False), ((576, 1536), True), ((5, 7), True), ((100, 96), True)]
TILED = packed.can_tile(torch.zeros(32, 32, dtype=torch.bfloat16))


def rowwise(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` one row at a time: what each row gives on its own."""
    return torch.cat([F.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])


@pytest.mark.parametrize("rows", [1, 3, 17, 32, 33, 128, 300, 2049])
@pytest.mark.parametrize("shape,bias", SHAPES)
def test_packed_linear_is_bit_identical_to_f_linear(rows, shape, bias) -> None:
    """oneDNN's packed product, and the tile kernel up to EXACT_ROWS rows, give F.linear's
    bits; above that the tile kernel gives each row what it gives alone (close to F.linear,
    whose last bits depend on the batch there)."""
    torch.manual_seed(rows)
    w = torch.randn(*shape, dtype=torch.bfloat16)
    b = torch.randn(shape[0], dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    tiles = packed.pack_tiles(w) if packed.can_tile(w) else None
    ref = F.linear(x, w, b)
    for t in {None, tiles}:
        got = packed.packed_linear(x, packed.pack(w), b, t, shape[0])
        assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
        if t is not None and packed.EXACT_ROWS < rows <= packed.tile_rows(t):
            assert torch.equal(got, rowwise(x, w, b))
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=0.1)
        else:
            assert torch.equal(got, ref)


@pytest.mark.skipif(not TILED, reason="no AMX tiles for this process")
@pytest.mark.parametrize("rows", [2, 31, 48, 100, 160, 300])
@pytest.mark.parametrize("shape,bias", SHAPES[:2])
def test_tile_rows_do_not_depend_on_the_batch(rows, shape, bias) -> None:
    """Each row of a tile product (whole 32-row blocks read in place, a padded tail block
    of 1-31 rows) is the single-row product's, in any batch of up to `tile_rows` rows: a
    decode step's request gets the same bits whatever else runs beside it."""
    torch.manual_seed(rows)
    w = torch.randn(*shape, dtype=torch.bfloat16)
    b = torch.randn(shape[0], dtype=torch.bfloat16) if bias else None
    tiles, pack = packed.pack_tiles(w), packed.pack(w)
    top = packed.tile_rows(tiles)
    assert top == 512  # a small weight's
    x = torch.randn(top, shape[1], dtype=torch.bfloat16)
    one = [packed.packed_linear(x[i : i + 1], pack, b, tiles, shape[0]) for i in range(rows)]
    alone = torch.cat(one)
    assert torch.equal(alone, rowwise(x[:rows], w, b))  # one row: F.linear's bits
    for start in (0, top - rows):  # the same rows among others, at any offset
        batch = packed.packed_linear(x[: start + rows], pack, b, tiles, shape[0])
        assert torch.equal(batch[start:], rowwise(x[start : start + rows], w, b))


@pytest.mark.skipif(not TILED, reason="no AMX tiles for this process")
@pytest.mark.parametrize("out,top", [(200, 512), (48 * 1024, 160), (160 * 1024, 96)])
def test_tiles_take_up_to_tile_rows_and_onednn_the_rest(out, top) -> None:
    """Given different weights in the two copies, the product shows which one served: up to
    512 rows on the tiles for a small weight, fewer for larger ones (6 and 20 MiB here)."""
    torch.manual_seed(0)
    tiled, onednn = (torch.randn(out, 64, dtype=torch.bfloat16) for _ in range(2))
    tiles, pack = packed.pack_tiles(tiled), packed.pack(onednn)
    assert packed.tile_rows(tiles) == top
    for rows, want in ((1, tiled), (32, tiled), (33, tiled), (top, tiled), (top + 1, onednn)):
        x = torch.randn(2, rows, 64, dtype=torch.bfloat16)[0]  # rows of a larger tensor
        got = packed.packed_linear(x, pack, None, tiles, out)
        if want is tiled:  # the tiles' rows, as each gives alone (every row of the small
            # weight's product; three of the big ones', whose row-by-row products are slow)
            pick = torch.arange(rows) if out <= 200 else torch.tensor([0, rows // 2, rows - 1])
            assert torch.equal(got[pick], rowwise(x[pick], tiled))
        else:
            assert torch.equal(got, F.linear(x, onednn))
    tiles, pack = packed.pack_tiles(tiled[:200]), packed.pack(onednn[:200])
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)  # [..., in]: 15 rows, leading dims kept
    got = packed.packed_linear(x, pack, None, tiles, 200)
    assert got.shape == (3, 5, 200) and torch.equal(got, F.linear(x, tiled[:200]))
    assert not packed.can_tile(torch.zeros(8, 48, dtype=torch.bfloat16))  # in % 32 != 0


def test_only_bf16_cpu_weights_are_packed_where_bf16_is_fast(monkeypatch) -> None:
    # float32 stays on F.linear where the CPU serves in bf16 (test_packed_float32.py: the
    # other CPUs)
    assert not packed.can_pack(torch.zeros(2, 2))
    assert not packed.can_pack(torch.zeros(2, 2, dtype=torch.float16))
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "0")
    assert not packed.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("tied", [True, False])
def test_loaded_bf16_model_packs_and_gives_the_same_logits(tmp_path, monkeypatch, tied) -> None:
    """Loading in bf16 packs every linear weight (releasing the dense copy, except the tied
    embedding's) and the model's logits are exactly those of the unpacked model."""
    from attention_checks import two_prompt_logits as logits

    from kvray.bench.tiny import write_tiny_checkpoint
    from kvray.models import TPGroup, load_model

    write_tiny_checkpoint(tmp_path, "qwen2", num_hidden_layers=2, tie_word_embeddings=tied)

    model = load_model(tmp_path, TPGroup(), torch.bfloat16, "cpu")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert lin._packed is not None and lin.weight.device.type == "meta"
        assert (lin._tiles is not None) == TILED  # a small model gets the tile copies
    untiled = load_model(tmp_path, TPGroup(), torch.bfloat16, "cpu", small_batch_kernel=False)
    assert untiled.model.layers[0].mlp.down_proj._tiles is None
    assert torch.equal(logits(model), logits(untiled))  # 18 rows: the tiles served `model`
    head = model.lm_head
    assert head._packed is not None
    assert head.weight.device.type == ("cpu" if tied else "meta")
    assert model.model.embed_tokens.weight.device.type == "cpu"  # the lookup needs it
    with pytest.raises(RuntimeError, match="packed"):
        layer.mlp.down_proj.load_weight("weight", torch.zeros(1, 1))

    monkeypatch.setattr(packed, "can_pack", lambda w: False)
    dense = load_model(tmp_path, TPGroup(), torch.bfloat16, "cpu")
    assert dense.model.layers[0].self_attn.qkv_proj._packed is None
    assert torch.equal(logits(model), logits(dense))


@pytest.mark.skipif(not TILED, reason="no AMX tiles for this process")
@pytest.mark.usefixtures("engine_invariants")
def test_bf16_requests_get_the_same_bits_alone_and_in_a_batch(tmp_path) -> None:
    """End to end in bfloat16: a request's tokens and logprobs are bit for bit the same
    whether it runs alone or among 47 others, as long as every step's products have at most
    `tile_rows` rows (48 three-token prompts: a 144-row prefill, then 48-row decode steps).
    Every other op of the step works row by row or request by request. The embedded model's
    layer shapes (oneDNN's products of them change in the last bits with the batch from 33
    rows on; at the tiny models' widths they do not), two layers."""
    import random

    from engine_checks import new_llm

    from kvray import SamplingParams
    from kvray.bench.tiny import write_tiny_checkpoint

    shape = dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_hidden_layers=2
    )
    write_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=3, **shape)
    llm = new_llm(tmp_path, dtype="bfloat16", skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(3)] for _ in range(48)]
    tiles = [
        m._tiles
        for m in llm.engine.worker.model.modules()
        if getattr(m, "_tiles", None) is not None
    ]
    assert tiles and 48 * 3 <= min(packed.tile_rows(t) for t in tiles)
    alone = llm.generate(prompts[:1], [sp])[0]
    together = llm.generate(prompts, [sp] * len(prompts))[0]
    assert together.token_ids == alone.token_ids and len(alone.token_ids) == 12
    assert together.logprobs == alone.logprobs  # floats compared exactly: the same bits


@pytest.mark.skipif(not TILED, reason="no AMX tiles for this process")
@pytest.mark.parametrize("rows", [1, 17, 32, 33, 100, 300, 512])
def test_silu_mul_tiles_gives_the_two_steps_bits(rows) -> None:
    """The fused [gate | up] product and silu(gate) * up give what the product on the tiles
    and then `fused.silu_mul` give, bit for bit, gates large and small included; rows the
    tiles would not take, or an intermediate size off the 32-column blocks, are declined."""
    from kvray.models import fused

    torch.manual_seed(rows)
    inter, hidden = 1536, 576
    w = torch.randn(2 * inter, hidden, dtype=torch.bfloat16) * 0.05
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    x[::3] *= 40  # gates far out on both sides, where silu saturates or underflows
    tiles, pack = packed.pack_tiles(w), packed.pack(w)
    got = packed.silu_mul_tiles(x, tiles, inter)
    two_steps = fused.silu_mul(packed.packed_linear(x, pack, None, tiles, 2 * inter))
    assert got is not None and got.shape == (rows, inter)
    assert torch.equal(got, two_steps)
    if rows <= packed.EXACT_ROWS:  # and F.linear's, where the tiles give its bits
        assert torch.equal(got, fused.silu_mul_reference(F.linear(x, w)))
    top = packed.tile_rows(tiles)
    assert (
        packed.silu_mul_tiles(torch.zeros(top + 1, hidden, dtype=torch.bfloat16), tiles, inter)
        is None
    )
    odd = packed.pack_tiles(torch.randn(2 * 48, hidden, dtype=torch.bfloat16))
    assert packed.silu_mul_tiles(x, odd, 48) is None
