"""Where `kvray bench offline`'s time goes, in process: per step kind, per op family.

    python scripts/profile_offline.py [--num-requests 128] [--max-prefill-tokens 4096]

Runs (with tcmalloc preloaded where the system has it, as the bench does) the bench's
default workload (same seed, prompts, output lengths, engine settings;
bfloat16 on all cores) through `kvray.LLM` once untimed at a small size, then once timed,
wall-clocking every engine step and, inside it, every call of the hot op families:
    linear        the linear layers (`kvray.models.packed.packed_linear`, and
                  `silu_mul_tiles`: the MLP's gate_up product with its SiLU-mul)
    attn_decode   the C++ paged decode kernel (`kvray.attention.cpu_paged`)
    attn_prompt   prompt (chunk) attention: the AMX kernel (`cpu_paged.paged_extend`),
                  or torch's SDPA where that kernel declines
    fused         the C++ norm / RoPE / SiLU-mul kernels (`kvray.models.fused`)
    store_kv      writing each layer's K/V into the pool (`kvray.kvcache.cpu_store`)
Steps are split into those that compute prompt tokens ("prefill", decodes riding along)
and decode-only steps (with any speculative drafts they check), whose times are also binned
by batch size. A CPU computes eagerly, so wall clocks around calls measure them; wrapping
costs a few microseconds per call.

With --steps it measures instead what `scripts/profile_vllm_steps.py` measures of vLLM, the
same way, unprofiled (medians of repeats; random token-id prompts, greedy, EOS ignored):
    prefill_N_ms   one N-token prompt, one output token (the whole request)
    decode_B_ms    B requests of 320-token prompts: (time for 33 tokens - time for 1) / 32
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import statistics
import time
from typing import Any

import torch.nn.functional as F

from kvray import LLM, SamplingParams
from kvray.attention import cpu_paged
from kvray.bench.offline import make_workload, run_kvray
from kvray.cluster.engine_core import EngineCore
from kvray.kvcache import cpu_store
from kvray.models import fused, packed
from kvray.workers.host_memory import reexec_with_tcmalloc

FAMILIES = {
    "linear": [(packed, "packed_linear"), (packed, "silu_mul_tiles")],
    "attn_decode": [(cpu_paged, "paged_decode")],
    "attn_prompt": [(cpu_paged, "paged_extend"), (F, "scaled_dot_product_attention")],
    "fused": [(fused, n) for n in ("rms_norm", "add_rms_norm", "silu_mul", "rotary")],
    "store_kv": [(cpu_store, "store")],
}

_spent: dict[str, float] = collections.defaultdict(float)


def _timed(family: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        _spent[family] += time.perf_counter() - t
        return out

    return call


def _instrument() -> None:
    for family, sites in FAMILIES.items():
        for module, name in sites:
            setattr(module, name, _timed(family, getattr(module, name)))


def step_times(llm: LLM, repeats: int) -> dict[str, float]:
    """kvray's step times, measured as `scripts/profile_vllm_steps.py` measures vLLM's."""
    rng = random.Random(0)
    vocab = llm.spec.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]

    def generate(batch: list[list[int]], tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(batch, [sp] * len(batch))
        return time.perf_counter() - t

    result: dict[str, float] = {}
    for length in (256, 2048):
        times = [generate(prompts(1, length), 1) for _ in range(repeats + 2)]
        result[f"prefill_{length}_ms"] = statistics.median(times) * 1e3
    for batch in (1, 4, 64):
        steps = []
        for _ in range(repeats):
            one = generate(prompts(batch, 320), 1)
            many = generate(prompts(batch, 320), 33)
            steps.append((many - one) / 32)
        result[f"decode_{batch}_ms"] = statistics.median(steps) * 1e3
    return {k: round(v, 1) for k, v in result.items()}


def main() -> None:
    reexec_with_tcmalloc()  # as `kvray bench offline` runs
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", action="store_true", help="step times, as profile_vllm_steps.py")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative-tokens", type=int, default=None, help="(default: the engine's)")
    args = ap.parse_args()
    engine_args = {}
    if args.speculative_tokens is not None:
        engine_args["speculative_tokens"] = args.speculative_tokens

    llm = LLM(
        dtype="bfloat16",
        max_running_reqs=max(args.num_requests, 128),
        max_prefill_tokens=args.max_prefill_tokens,
        seed=args.seed,
        progress=False,
        **engine_args,
    )
    vocab = llm.spec.vocab_size
    wl = make_workload(
        args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed
    )
    run_kvray(llm, make_workload(min(args.num_requests, 64), (16, 48), (4, 8), vocab, 1))
    if args.steps:
        print(json.dumps(step_times(llm, args.repeats)))
        return

    _instrument()
    steps: list[tuple[str, int, float, dict[str, float]]] = []  # kind, decodes, s, spent
    executor = llm.engine.executor
    submit = executor.submit
    planned: list[tuple[int, int]] = []  # (prompt tokens, decodes) of each plan

    def record_plan(plan: Any) -> Any:
        decodes = plan.extend_lens == 1
        if plan.num_drafts is not None:
            decodes |= plan.num_drafts > 0
        prompt = int(plan.extend_lens[~decodes].sum())
        planned.append((prompt, int(decodes.sum())))
        return submit(plan)

    executor.submit = record_plan  # type: ignore[method-assign]
    step = EngineCore.step

    def timed_step(core: EngineCore) -> Any:
        _spent.clear()
        n = len(planned)
        t = time.perf_counter()
        out = step(core)
        dt = time.perf_counter() - t
        if len(planned) > n:
            prompt, decodes = planned[-1]
            kind = "prefill" if prompt else "decode"
            steps.append((kind, decodes, dt, dict(_spent)))
        return out

    EngineCore.step = timed_step  # type: ignore[method-assign]
    rates = run_kvray(llm, wl)
    EngineCore.step = step  # type: ignore[method-assign]

    print(
        f"{args.num_requests} requests, {wl.input_tokens} prompt + {wl.output_tokens} output "
        f"tokens: {rates['elapsed_s']:.1f} s, {rates['output_tok_s']:.1f} output tok/s"
    )
    families = list(FAMILIES)
    print(f"{'steps':>8} {'n':>4} {'total s':>8} " + " ".join(f"{f:>11}" for f in families))
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s[0] == kind]
        total = sum(s[2] for s in mine)
        per = [sum(s[3].get(f, 0.0) for s in mine) for f in families]
        print(f"{kind:>8} {len(mine):4d} {total:8.2f} " + " ".join(f"{p:11.2f}" for p in per))
    bins: dict[int, list[float]] = collections.defaultdict(list)
    for kind, decodes, dt, _ in steps:
        if kind == "decode":
            bins[decodes // 32 * 32].append(dt)
    for lo in sorted(bins):
        ms = statistics.median(bins[lo]) * 1e3
        print(f"decode-only steps, batch {lo}-{lo + 31}: {len(bins[lo])} steps, p50 {ms:.1f} ms")
    llm.engine.check_integrity()


if __name__ == "__main__":
    main()
