"""Parity of the kvray model path (loader + Llama family + torch attention + paged pool)
with Hugging Face transformers on tiny random checkpoints, at TP 1, 2 and 4."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvray.attention import AttnMetadata, create_attention_backend
from kvray.kvcache import create_kvcache_pool
from kvray.models import LlamaForCausalLM, ModelConfig, TPGroup, load_model
from kvray.net import free_port

COMMON = dict(
    vocab_size=301,  # not a multiple of 2 or 4: exercises vocab padding under TP
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # large weights: decisive logits, stable greedy paths
    eos_token_id=None,  # never stop early in generate
    bos_token_id=None,
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the blend band covers our dims
}
VARIANTS = {
    "llama": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(num_hidden_layers=2, rope_parameters=LLAMA3_ROPE)),
    "linear_rope_bias": (
        "llama",
        dict(
            num_hidden_layers=2,
            attention_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
    ),
    "qwen2": ("qwen2", dict(num_hidden_layers=3, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)),
}


def _hf_model(kind: str, **kw):
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**COMMON, **kw})).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Each variant saved once; the HF model is kept for reference outputs."""
    out = {}
    for name, (kind, kw) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = _hf_model(kind, **kw)
        hf.save_pretrained(path)
        out[name] = (path, hf)
    return out


class Runner:
    """A minimal stand-in for a worker: a paged pool, a page table whose rows get pages
    from a shuffled free list, and one forward per step."""

    def __init__(self, model: LlamaForCausalLM, page_size: int, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.page_size = page_size
        num_pages = 512 // page_size
        self.cache = create_kvcache_pool(
            num_kv_heads=cfg.num_kv_heads,
            num_layers=cfg.num_layers,
            head_dim=cfg.head_dim,
            num_pages=num_pages,
            page_size=page_size,
            dtype=model.dtype,
            device=model.device,
            tp_size=model.tp.size,
        )
        self.attn = create_attention_backend(
            "auto", self.cache, model.num_q_heads_local, cfg.head_dim, model.attn_scale
        )
        gen = torch.Generator().manual_seed(seed)
        self.free_pages = torch.randperm(num_pages, generator=gen).tolist()
        self.dummy_slot = num_pages * page_size  # the extra page the pool appends
        self.table = torch.zeros((8, 256), dtype=torch.int32)
        self.allocated = [0] * 8

    def share_prefix(self, dst: int, src: int, length: int) -> None:
        """Point row dst's first `length` positions (whole pages) at row src's slots."""
        assert length % self.page_size == 0
        self.table[dst, :length] = self.table[src, :length]
        self.allocated[dst] = length

    def _allocate(self, row: int, end: int) -> None:
        while self.allocated[row] < end:
            page = self.free_pages.pop()
            pos = self.allocated[row]
            self.table[row, pos : pos + self.page_size] = page * self.page_size + torch.arange(
                self.page_size
            )
            self.allocated[row] += self.page_size

    def step(self, batch: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """batch = [(row, start, token ids)]; returns each request's logits [len(ids), V]."""
        logits = self.logits_at(batch, torch.arange(sum(len(ids) for _, _, ids in batch)))
        return list(logits.split([len(ids) for _, _, ids in batch]))

    def logits_at(
        self, batch: list[tuple[int, int, list[int]]], rows: torch.Tensor
    ) -> torch.Tensor:
        """One step of `batch` (as `step`) that asks for the logits of the flat batch's
        `rows` only."""
        for row, start, ids in batch:
            self._allocate(row, start + len(ids))
        meta = AttnMetadata.build(
            self.table,
            [r for r, _, _ in batch],
            [s for _, s, _ in batch],
            [len(ids) for _, _, ids in batch],
            self.dummy_slot,
        )
        self.attn.prepare(meta)
        input_ids = torch.tensor([t for _, _, ids in batch for t in ids])
        return self.model(input_ids, meta.positions, self.attn, rows)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 301, (length - 3 * i,), generator=gen).tolist() for i in range(n)]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _run_schedule(runner: Runner, prompts, schedules, first_steps) -> list[torch.Tensor]:
    """Request i joins at step first_steps[i] and computes chunks of sizes schedules[i]
    (the rest one token at a time); every step batches whatever each request has next."""
    done = [0] * len(prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        batch, who = [], []
        for i, p in enumerate(prompts):
            if step < first_steps[i] or done[i] >= len(p):
                continue
            k = len(got[i])
            size = schedules[i][k] if k < len(schedules[i]) else 1
            batch.append((i, done[i], p[done[i] : done[i] + size]))
            who.append(i)
        for i, logits in zip(who, runner.step(batch), strict=True):
            got[i].append(logits)
            done[i] += logits.shape[0]
        step += 1
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_prompt_matches_hf(checkpoints, variant: str) -> None:
    path, hf = checkpoints[variant]
    model = load_model(path, TPGroup(), torch.float32, "cpu")
    runner = Runner(model, page_size=4)
    prompts = _prompts(2, 21, seed=1)
    out = runner.step([(i, 0, p) for i, p in enumerate(prompts)])
    for p, logits in zip(prompts, out, strict=True):
        torch.testing.assert_close(logits, _hf_logits(hf, p), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("variant", "page_size"), [("llama", 1), ("qwen2", 4), ("qwen3", 16), ("llama3_rope", 4)]
)
def test_chunked_prefill_decode_and_prefix_reuse(checkpoints, variant: str, page_size: int) -> None:
    """Half the prompt, then chunks, then token by token, mixed in one batch with another
    request's prefill and decodes, and a third request reusing the first's cached prefix."""
    path, hf = checkpoints[variant]
    model = load_model(path, TPGroup(), torch.float32, "cpu")
    runner = Runner(model, page_size=page_size, seed=page_size)
    a, b = _prompts(2, 24, seed=2)
    got_a, got_b = _run_schedule(runner, [a, b], [[12, 3, 5], [7, 2]], [0, 1])
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=1e-4, rtol=1e-4)

    shared = 16  # page aligned for every page size used here
    c = a[:shared] + [5, 6, 7]
    runner.share_prefix(2, 0, shared)
    (tail,) = runner.step([(2, shared, c[shared:])])
    torch.testing.assert_close(tail, _hf_logits(hf, c)[shared:], atol=1e-4, rtol=1e-4)


def test_only_the_sampled_rows_go_past_the_last_layers_attention(checkpoints) -> None:
    """The last layer's o_proj and MLP run on the rows whose logits a step wants, and
    their logits are HF's; every token's K/V is still stored, so a chunk that samples
    nothing leaves the cache right for the next one."""
    path, hf = checkpoints["qwen2"]  # a qkv bias and an untied LM head
    model = load_model(path, TPGroup(), torch.float32, "cpu")
    runner = Runner(model, page_size=4)
    mlp_rows: list[int] = []
    model.model.layers[-1].mlp.register_forward_hook(
        lambda _mod, args, _out: mlp_rows.append(args[0].shape[0])
    )
    first_mlp_rows: list[int] = []
    model.model.layers[0].mlp.register_forward_hook(
        lambda _mod, args, _out: first_mlp_rows.append(args[0].shape[0])
    )
    a, b = _prompts(2, 21, seed=3)
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    none = runner.logits_at([(0, 0, a[:12]), (1, 0, b[:8])], torch.zeros(0, dtype=torch.long))
    assert none.shape[0] == 0
    # a's rest (rows 0-8 of the flat batch) and b's rest (rows 9-18): a few rows of each
    rows = torch.tensor([0, 8, 9, 14, 18])
    got = runner.logits_at([(0, 12, a[12:]), (1, 8, b[8:])], rows)
    want = torch.stack([ref_a[12], ref_a[20], ref_b[8], ref_b[13], ref_b[17]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert first_mlp_rows == [20, 19]  # every token, in every layer but the last
    assert mlp_rows == [0, 5]


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_greedy_decode_matches_hf_generate(checkpoints, variant: str) -> None:
    path, hf = checkpoints[variant]
    model = load_model(path, TPGroup(), torch.float32, "cpu")
    runner = Runner(model, page_size=4, seed=3)
    prompts = _prompts(3, 11, seed=3)
    seqs = [list(p) for p in prompts]
    batch = [(i, 0, p) for i, p in enumerate(prompts)]
    for _ in range(16):  # all requests decode together, in one batch per step
        out = runner.step(batch)
        for i, logits in enumerate(out):
            seqs[i].append(int(logits[-1].argmax()))
        batch = [(i, len(s) - 1, s[-1:]) for i, s in enumerate(seqs)]
    for p, s in zip(prompts, seqs, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        assert s == ref[0].tolist()


def test_config_parsing(checkpoints, tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(checkpoints["qwen2"][0])
    assert (cfg.architecture, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (
        "Qwen2ForCausalLM",
        True,
        False,
        False,
    )
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (2, 16, False)
    cfg = ModelConfig.from_pretrained(checkpoints["qwen3"][0])
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.tie_word_embeddings
    cfg = ModelConfig.from_pretrained(checkpoints["llama3_rope"][0])
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_theta == 500000.0 and cfg.dtype == torch.float32

    # Older checkpoints: top-level rope_theta and a rope_scaling dict with "type".
    raw = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.pop("dtype", None)
    old = {
        **raw,
        "rope_theta": 1234.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 7],
        "torch_dtype": "bfloat16",
    }
    cfg = ModelConfig.from_dict(old)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling.factor == 2.0
    assert cfg.eos_token_ids == (5, 7) and cfg.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({**raw, "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    incomplete = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    with pytest.raises(ValueError, match=r"llama3 rope scaling needs rope_scaling\.low_freq"):
        ModelConfig.from_dict({**raw, "rope_parameters": incomplete})


def test_engine_spec_eos_ids_and_tp_split(checkpoints, tmp_path: Path) -> None:
    """The EOS ids are generation_config.json's where it exists (as `generate` reads them:
    one without any stops nowhere), config.json's otherwise; a TP size that cannot split
    the model is refused before any worker starts, naming the config field."""
    from kvray.cluster.spec import EngineSpec
    from kvray.config import EngineConfig

    def spec(path: Path, tp_size: int = 1) -> EngineSpec:
        return EngineSpec.resolve(EngineConfig(model=str(path), tp_size=tp_size), progress=False)

    def eos_in(c: dict) -> None:
        c["eos_token_id"] = [3, 9]

    path = _copy_checkpoint(checkpoints["llama"][0], tmp_path / "eos", eos_in)
    gen = path / "generation_config.json"
    assert spec(path).eos_token_ids == (3, 9)
    gen.write_text(json.dumps({"eos_token_id": 11}))
    assert spec(path).eos_token_ids == (11,)
    gen.write_text(json.dumps({"eos_token_id": [12, 4]}))
    assert spec(path).eos_token_ids == (4, 12)
    gen.write_text(json.dumps({"max_new_tokens": 5}))
    assert spec(path).eos_token_ids == ()

    # COMMON: 4 heads, 2 KV heads, intermediate 128
    assert spec(path, tp_size=4).model_config.num_heads == 4  # KV heads replicated
    with pytest.raises(ValueError, match="tp_size 3 cannot split the model's num_attention_heads"):
        spec(path, tp_size=3)
    odd_mlp = _copy_checkpoint(path, tmp_path / "mlp", lambda c: c.update(intermediate_size=130))
    with pytest.raises(ValueError, match="tp_size 4 cannot split the model's intermediate_size"):
        spec(odd_mlp, tp_size=4)


def test_auto_dtype_follows_the_device(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: a float32 checkpoint runs in bfloat16 on a GPU and on a CPU with fast bfloat16
    (oneDNN's AVX-512 kernels); on a CPU without them every checkpoint runs in float32, where
    bfloat16 would be several times slower. An explicit dtype is kept everywhere."""
    from kvray.cluster import spec as spec_module
    from kvray.cluster.spec import EngineSpec, cpu_has_fast_bfloat16, resolve_dtype
    from kvray.config import EngineConfig

    fast = cpu_has_fast_bfloat16()
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        assert not fast  # no AVX-512: torch's bfloat16 matmul is its slow reference
    assert resolve_dtype("auto", torch.float32, "cuda") == "bfloat16"
    assert resolve_dtype("auto", torch.float16, "cuda") == "float16"
    assert resolve_dtype("auto", torch.float32, "cpu") == ("bfloat16" if fast else "float32")
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == ("bfloat16" if fast else "float32")
    assert resolve_dtype("bfloat16", torch.float32, "cpu") == "bfloat16"
    path, _ = checkpoints["llama"]  # a float32 checkpoint
    for device in ("cpu", "auto") if not torch.cuda.is_available() else ("cpu",):
        spec = EngineSpec.resolve(EngineConfig(model=str(path), device=device), progress=False)
        assert spec.dtype == ("bfloat16" if fast else "float32")
    # the CPU of the other answer
    monkeypatch.setattr(spec_module, "cpu_has_fast_bfloat16", lambda: not fast)
    assert resolve_dtype("auto", torch.float32, "cpu") == ("float32" if fast else "bfloat16")


def test_sharded_index_and_missing_weights(checkpoints, tmp_path: Path) -> None:
    """Many safetensors files with an index load like one; a missing tensor is an error."""
    from safetensors.torch import load_file, save_file

    src, hf = checkpoints["qwen2"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in files.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / fname)
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    model = load_model(tmp_path, TPGroup(), torch.float32, "cpu")
    ids = _prompts(1, 9, seed=4)[0]
    (logits,) = Runner(model, page_size=4).step([(0, 0, ids)])
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)

    os.remove(tmp_path / "model.safetensors.index.json")
    save_file(
        {k: tensors[k] for k in names[half:] if "k_proj" not in k},
        tmp_path / "model-00002-of-00002.safetensors",
    )
    with pytest.raises(ValueError, match="lacks"):
        load_model(tmp_path, TPGroup(), torch.float32, "cpu")

    only_pickled = tmp_path / "bin"
    only_pickled.mkdir()
    (only_pickled / "config.json").write_text((src / "config.json").read_text())
    (only_pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin: pickled weights"):
        load_model(only_pickled, TPGroup(), torch.float32, "cpu")


def _copy_checkpoint(src: Path, dst: Path, edit=None, tensors=None) -> Path:
    """`src` again at `dst`, its config.json changed by `edit`, its weights by `tensors`."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((src / "config.json").read_text())
    if edit is not None:
        edit(raw)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(raw))
    weights = load_file(src / "model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "model.safetensors")
    return dst


def test_checkpoints_that_would_compute_wrong_are_refused(checkpoints, tmp_path: Path) -> None:
    """A quantized checkpoint, a tensor of another dtype or shape than config.json implies:
    each refused by name, never loaded as if it were plain weights."""
    src, _ = checkpoints["qwen2"]
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    quantized = _copy_checkpoint(src, tmp_path / "q", lambda c: c.update(quantization_config=fp8))
    with pytest.raises(ValueError, match="quantized checkpoints are not supported.*'fp8'"):
        load_model(quantized, TPGroup(), torch.float32, "cpu")

    name = "model.layers.0.mlp.up_proj.weight"

    def int8(w: dict) -> dict:
        return {**w, name: w[name].to(torch.int8)}

    with pytest.raises(ValueError, match=rf"'{name}' is I8: quantized"):
        load_model(
            _copy_checkpoint(src, tmp_path / "i8", tensors=int8), TPGroup(), torch.float32, "cpu"
        )

    def fewer_kv_heads(c: dict) -> None:
        c["num_key_value_heads"] = 1  # the checkpoint holds 2

    narrow = _copy_checkpoint(src, tmp_path / "kv", fewer_kv_heads)
    with pytest.raises(ValueError, match=r"k_proj\.(weight|bias)' has shape \[32.*\[16"):
        load_model(narrow, TPGroup(), torch.float32, "cpu")

    no_layers = json.loads((src / "config.json").read_text()) | {"num_hidden_layers": 0}
    with pytest.raises(ValueError, match="num_hidden_layers is 0: need at least 1"):
        ModelConfig.from_dict(no_layers)


def test_config_variants_load_as_transformers_reads_them(checkpoints, tmp_path: Path) -> None:
    """A rope_scaling added by hand to a transformers-5 config wins over its rope_parameters;
    Qwen's use_sliding_window with no sliding layer is full attention; a tied checkpoint
    that saved only lm_head.weight serves it as the embedding. Each matches transformers."""
    import transformers as tf

    src, _ = checkpoints["llama"]
    ids = _prompts(1, 17, seed=6)[0]

    def check(path: Path) -> None:
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        (logits,) = Runner(load_model(path, TPGroup(), torch.float32, "cpu"), 4).step([(0, 0, ids)])
        torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)

    scaled = _copy_checkpoint(
        checkpoints["llama3_rope"][0],
        tmp_path / "rope",
        lambda c: c.update(
            max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0}
        ),
    )
    cfg = ModelConfig.from_pretrained(scaled)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear"
    check(scaled)
    # linear scaling stretches the context by its factor (vLLM's derived max_model_len);
    # a prompt past the unscaled context still matches transformers
    base = 64  # config.json's max_position_embeddings
    assert cfg.max_position_embeddings == 4 * base
    long_ids = _prompts(1, base + 24, seed=7)[0]
    hf = tf.AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    model = load_model(scaled, TPGroup(), torch.float32, "cpu")
    (logits,) = Runner(model, 4).step([(0, 0, long_ids)])
    torch.testing.assert_close(logits, _hf_logits(hf, long_ids), atol=1e-4, rtol=1e-4)

    def window_past_the_last_layer(c: dict) -> None:
        c.update(use_sliding_window=True, sliding_window=8, max_window_layers=3)

    check(_copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "swa", window_past_the_last_layer))
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict(
            {
                **json.loads((src / "config.json").read_text()),
                "layer_types": ["full_attention", "sliding_attention"],
            }
        )

    def head_only(w: dict) -> dict:
        w = dict(w)
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")
        return w

    check(_copy_checkpoint(src, tmp_path / "tied", tensors=head_only))

    # A config that says tied over a checkpoint that saved a head of its own, unlike the
    # embedding: transformers keeps the saved head, so the logits are the head's.
    untied = checkpoints["qwen2"][0]
    tied_config = _copy_checkpoint(
        untied, tmp_path / "distinct", lambda c: c.update(tie_word_embeddings=True)
    )
    assert not load_model(tied_config, TPGroup(), torch.float32, "cpu").config.tie_word_embeddings
    check(tied_config)
    # Qwen's MLP has no bias whatever config.json says (transformers reads no mlp_bias).
    check(
        _copy_checkpoint(
            checkpoints["qwen3"][0], tmp_path / "qwen_mlp", lambda c: c.update(mlp_bias=True)
        )
    )


def test_a_mistral_checkpoint_runs_as_transformers_reads_it(checkpoints, tmp_path: Path) -> None:
    """Mistral's layers are Llama's: the same weights under MistralForCausalLM give
    transformers' logits; a sliding window shorter than the context becomes the context
    (within it the window masks nothing)."""
    import transformers as tf

    def as_mistral(window: int | None):
        def edit(c: dict) -> None:
            c.update(architectures=["MistralForCausalLM"], model_type="mistral")
            c.update(sliding_window=window)

        return edit

    path = _copy_checkpoint(checkpoints["llama"][0], tmp_path / "mistral", as_mistral(None))
    ids = _prompts(1, 17, seed=8)[0]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    model = load_model(path, TPGroup(), torch.float32, "cpu")
    (logits,) = Runner(model, 4).step([(0, 0, ids)])
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert model.config.max_position_embeddings == COMMON["max_position_embeddings"]
    windowed = _copy_checkpoint(path, tmp_path / "windowed", as_mistral(64))
    assert ModelConfig.from_pretrained(windowed).max_position_embeddings == 64
    hf_windowed = tf.AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    assert hf_windowed.config.sliding_window == 64
    (logits,) = Runner(load_model(windowed, TPGroup(), torch.float32, "cpu"), 4).step([(0, 0, ids)])
    torch.testing.assert_close(logits, _hf_logits(hf_windowed, ids), atol=1e-4, rtol=1e-4)
    # a context asked for past the window is refused, not silently cut to it
    from kvray.cluster.spec import EngineSpec
    from kvray.config import EngineConfig

    def spec(max_seq_len: int) -> EngineSpec:
        config = EngineConfig(model=str(windowed), max_seq_len=max_seq_len, dtype="float32")
        return EngineSpec.resolve(config, progress=False)

    assert spec(64).max_seq_len == 64
    with pytest.raises(ValueError, match="max_seq_len 128 is longer than the model's context, 64"):
        spec(128)
    wide = _copy_checkpoint(path, tmp_path / "wide", as_mistral(4096))
    assert ModelConfig.from_pretrained(wide).max_position_embeddings == 256


def test_bfloat16_runs_close_to_float32(checkpoints) -> None:
    path, _ = checkpoints["qwen3"]
    ids = _prompts(1, 13, seed=5)[0]
    ref = Runner(load_model(path, TPGroup(), torch.float32, "cpu"), 4).step([(0, 0, ids)])[0]
    model = load_model(path, TPGroup(), torch.bfloat16, "cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    (out,) = Runner(model, 4).step([(0, 0, ids)])
    assert out.dtype == torch.bfloat16  # logits stay in the model's dtype; the sampler upcasts
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


# -- tensor parallelism over gloo ----------------------------------------------------------


def _tp_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        tp = TPGroup.from_process_group()
        model = load_model(path, tp, torch.float32, "cpu")
        runner = Runner(model, page_size=4, seed=rank)  # each rank its own slot layout
        prompts = _prompts(2, 20, seed=6)
        got = _run_schedule(runner, prompts, [[9, 4], [20]], [0, 1])
        if rank == 0:
            torch.save(got, os.path.join(out_dir, f"tp{world}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_rank(checkpoints, tmp_path: Path, world: int) -> None:
    """TP 2 shards the 2 KV heads; TP 4 replicates each over 2 ranks. The vocab (301)
    is padded in both. Logits must equal TP 1's."""
    import torch.multiprocessing as mp

    path, hf = checkpoints["qwen2"]  # untied LM head, qkv bias
    mp.spawn(_tp_worker, args=(world, free_port(), str(path), str(tmp_path)), nprocs=world)
    got = torch.load(tmp_path / f"tp{world}.pt")
    prompts = _prompts(2, 20, seed=6)
    for p, logits in zip(prompts, got, strict=True):
        torch.testing.assert_close(logits, _hf_logits(hf, p), atol=1e-4, rtol=1e-4)
