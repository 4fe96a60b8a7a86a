"""oneDNN-packed float32 linear weights, on CPUs without fast bfloat16 (AVX2 only), where
float32 is the dtype `auto` serves in: close to `F.linear` (another summation order), and a
loaded float32 model packs every linear weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.models import packed

pytestmark = pytest.mark.skipif(
    not packed.can_pack(torch.zeros(2, 2)),
    reason="float32 is packed only where oneDNN has no fast bfloat16 (and kernels are on)",
)


@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
@pytest.mark.parametrize("shape,bias", [((960, 576), False), ((576, 1536), True), ((5, 7), True)])
def test_packed_float32_is_f_linear_to_rounding(rows, shape, bias) -> None:
    torch.manual_seed(rows)
    w = torch.randn(shape)
    b = torch.randn(shape[0]) if bias else None
    x = torch.randn(rows, shape[1])
    got = packed.packed_linear(x, packed.pack(w), b)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    # Sums of up to 1536 unit-sized products in another order: float32's rounding of them.
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=5e-4)
    leading = packed.packed_linear(x.view(1, rows, -1), packed.pack(w), b)
    assert leading.shape == (1, rows, shape[0]) and torch.equal(leading[0], got)


def test_only_float32_is_packed_here(monkeypatch) -> None:
    assert packed.can_pack(torch.zeros(2, 2))
    assert not packed.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16))  # no fast bf16 here
    assert not packed.can_pack(torch.zeros(2, 2, dtype=torch.float16))
    assert not packed.can_tile(torch.zeros(32, 32))  # the tiles are bf16 only
    monkeypatch.setenv("KVRAY_CPU_KERNELS", "0")
    assert not packed.can_pack(torch.zeros(2, 2))


def test_loaded_float32_model_packs_and_gives_close_logits(tmp_path, monkeypatch) -> None:
    from attention_checks import two_prompt_logits as logits

    from kvray.bench.tiny import write_tiny_checkpoint
    from kvray.models import TPGroup, load_model

    write_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2, tie_word_embeddings=True)

    model = load_model(tmp_path, TPGroup(), torch.float32, "cpu")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert lin._packed is not None and lin.weight.device.type == "meta"
    assert model.lm_head._packed is not None
    assert model.model.embed_tokens.weight.device.type == "cpu"  # tied: the lookup needs it
    monkeypatch.setattr(packed, "can_pack", lambda w: False)
    dense = load_model(tmp_path, TPGroup(), torch.float32, "cpu")
    assert dense.model.layers[0].self_attn.qkv_proj._packed is None
    torch.testing.assert_close(logits(model), logits(dense), rtol=1e-5, atol=1e-5)
