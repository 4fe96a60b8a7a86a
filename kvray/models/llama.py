"""The Llama family (Llama, Qwen2, Qwen3) as one tensor-parallel implementation.

The batch is flat: the tokens of every request are concatenated, and attention (which alone
needs to know where one request ends) is delegated to an `AttentionBackend` that the caller
has already `prepare`d for this step. Module names mirror the Hugging Face checkpoint, with
q/k/v merged into `qkv_proj` and gate/up into `gate_up_proj`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvray.kvcache.base import div_even
from kvray.models.config import ModelConfig
from kvray.models.layers import (
    ColumnParallelLinear,
    PackableLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    shard,
)
from kvray.models.tp import TPGroup

if TYPE_CHECKING:  # the model only calls attn.forward; it never builds a backend
    from kvray.attention.base import AttentionBackend


def _scale(s: slice, k: int) -> slice:
    return slice(s.start * k, s.stop * k)


# The most memory the small-batch kernel's second copy of the weights may take unasked
# (this rank's linear weights; 4 GiB: models up to about 2B parameters in bf16).
SMALL_BATCH_AUTO_BYTES = 4 << 30


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, layer_id: int) -> None:
        super().__init__()
        d = config.head_dim
        q_heads = shard(config.num_heads, tp)
        kv_heads = shard(config.num_kv_heads, tp, replicate=True)
        self.layer_id = layer_id
        self.head_dim = d
        self.num_q_heads = q_heads.stop - q_heads.start  # local
        self.num_kv_heads = kv_heads.stop - kv_heads.start  # local
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [_scale(q_heads, d), _scale(kv_heads, d), _scale(kv_heads, d)],
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            _scale(q_heads, d), config.hidden_size, bias=config.o_bias, tp=tp
        )
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output for every token, or for the tokens `rows` only
        (every token's K/V is still stored: later tokens attend to them)."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(
            [self.num_q_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q = q.reshape(t, self.num_q_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before rope
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k are views of this step's fresh projection (or norm output), so they may be
        # rotated in place.
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(q, k, v, self.layer_id)
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        cols = shard(config.intermediate_size, tp)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [cols, cols], bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(cols, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj's product is [gate | up] (this rank's columns of each)
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels as a pair: it is `h + residual`, or `h` alone when
        residual is None (the embeddings, before the first layer). Returns the pair after
        this layer: (MLP output, stream before the MLP). Leaving each residual add to the
        next RMSNorm lets the two run as one fused op; the sums are bit for bit those of
        `x = x + attn(norm(x)); x = x + mlp(norm(x))`. With `rows`, the pair holds those
        tokens only: past the attention (which stores every token's K/V), each row's
        computation is its own, so the others are not computed."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        out = self.self_attn(x, cos, sin, attn, rows)
        if rows is not None:
            residual = residual[rows]
        x, residual = self.post_attention_layernorm.add_and_norm(out, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """One TP shard of the model. Parameters are allocated uninitialised on `device` in
    `dtype`; `kvray.models.loader.load_model` fills them from a checkpoint."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        div_even(config.num_heads, tp.size)  # q heads split evenly, never replicated
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.device = torch.device(device)
        # What this shard's attention backend and KV pool must be built for.
        self.num_q_heads_local = config.num_heads // tp.size
        self.num_kv_heads_local = div_even(config.num_kv_heads, tp.size, allow_replicate=True)
        self.attn_scale = config.head_dim**-0.5
        with torch.device("meta"):  # build shapes only; real memory comes once, in `dtype`
            self.model = LlamaModel(config, tp)
            self.lm_head = (
                self.model.embed_tokens
                if config.tie_word_embeddings
                else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            )
        self.to(dtype)
        self.to_empty(device=self.device)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, self.device
        )

    def pack_weights(self, small_batch: bool | None = None) -> int:
        """Pack every linear weight for this CPU once loaded (see `kvray.models.packed`:
        bf16 where oneDNN's bf16 is fast, float32 where it is not, else a no-op). A tied LM
        head keeps its dense copy for the embedding.
        `small_batch` adds each weight's AMX tile copy for products of a few rows; None:
        where those copies take at most SMALL_BATCH_AUTO_BYTES. Returns how many weights
        were packed."""
        mods = [
            (name, mod)
            for name, mod in self.named_modules()
            if isinstance(mod, PackableLinear)
            # an untied embedding is only looked up, never multiplied
            and (name != "model.embed_tokens" or self.config.tie_word_embeddings)
        ]
        if small_batch is None:
            size = sum(m.weight.numel() * m.weight.element_size() for _, m in mods)
            small_batch = size <= SMALL_BATCH_AUTO_BYTES
        return sum(
            mod.pack_weights(keep_dense=name == "model.embed_tokens", tiles=small_batch)
            for name, mod in mods
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (flat batch). Returns logits [S, vocab_size] in the
        model's dtype (the sampler upcasts what it needs) for the rows `logits_indices`
        only. `attn` must be prepared for this batch."""
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        h, residual = self.model.embed_tokens(input_ids), None  # see LlamaDecoderLayer
        *layers, last = self.model.layers
        for layer in layers:
            h, residual = layer(h, residual, cos, sin, attn)
        # Only the rows whose logits are wanted go on past the last layer's attention: a
        # prompt's other tokens (a 256-token prompt: 255 of them) are needed there only for
        # their K/V, so the last layer's o_proj and MLP (84% of its products in the
        # embedded model) run on the sampled rows alone.
        h, residual = last(h, residual, cos, sin, attn, logits_indices)
        h, _ = self.model.norm.add_and_norm(h, residual)
        return self.lm_head.logits(h)
