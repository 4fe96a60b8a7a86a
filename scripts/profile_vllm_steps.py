"""vLLM's CPU step times and their op breakdown, for comparing with kvray's
(`scripts/profile_offline.py`). Runs inside vLLM's venv (scripts/install_vllm_cpu.sh), with
the environment `kvray bench offline --baseline vllm` gives it:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:.venv-vllm/lib/libiomp5.so \\
    VLLM_CPU_OMP_THREADS_BIND=0,1 VLLM_CPU_KVCACHE_SPACE=4 OMP_NUM_THREADS=2 \\
    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python scripts/profile_vllm_steps.py CHECKPOINT \\
        [--profile-dir /tmp/vllm-profile]

Random token-id prompts, greedy, EOS ignored, bfloat16, 4096-token prefill chunks (the
offline bench's settings). Step times, medians of repeats:
    prefill_N_ms   one N-token prompt, one output token (the whole request)
    decode_B_ms    B requests of 320-token prompts: (time for 33 tokens - time for 1) / 32
With --profile-dir, vLLM's torch profiler then records B=64 requests decoding and one
2048-token prompt, and the script prints, for one decode step and the prefill steps, the
time of each of vLLM's custom ops (`_C::...`) inside the step and the rest ("other":
torch.compile'd elementwise code and Python).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import random
import statistics
import time
from typing import Any


def _op_breakdown(trace_path: str) -> None:
    with gzip.open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("_C::")]
    for step in (e for e in events if e["name"].startswith("execute_context")):
        start, end = step["ts"], step["ts"] + step["dur"]
        if step["dur"] < 1000:  # empty steps
            continue
        spent: dict[str, float] = collections.defaultdict(float)
        for op in ops:
            if start <= op["ts"] <= end:
                spent[op["name"][4:]] += op["dur"] / 1e3
        parts = sorted(spent.items(), key=lambda kv: -kv[1])
        other = step["dur"] / 1e3 - sum(spent.values())
        print(
            f"  {step['name']}: {step['dur'] / 1e3:.1f} ms = "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in parts[:4])
            + f", other {other:.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--profile-dir", default=None, help="absolute path for vLLM's traces")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if args.profile_dir:
        extra["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": os.path.abspath(args.profile_dir),
            "torch_profiler_with_stack": False,
        }
    llm = LLM(
        model=args.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        seed=0,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        disable_log_stats=True,
        **extra,
    )
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompts(n: int, length: int) -> list[dict[str, list[int]]]:
        ids = [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]
        return [{"prompt_token_ids": p} for p in ids]

    def generate(batch: list[dict[str, list[int]]], tokens: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(batch, [sp] * len(batch), use_tqdm=False)
        return time.perf_counter() - t

    generate(prompts(64, 48), 8)  # warm up (torch.compile, allocator)
    result: dict[str, float] = {}
    for length in (256, 2048):
        times = [generate(prompts(1, length), 1) for _ in range(args.repeats + 2)]
        result[f"prefill_{length}_ms"] = statistics.median(times) * 1e3
    for batch in (1, 4, 64):
        steps = []
        for _ in range(args.repeats):
            one = generate(prompts(batch, 320), 1)
            many = generate(prompts(batch, 320), 33)
            steps.append((many - one) / 32)
        result[f"decode_{batch}_ms"] = statistics.median(steps) * 1e3
    print(json.dumps({k: round(v, 1) for k, v in result.items()}))

    if args.profile_dir:
        llm.start_profile()
        generate(prompts(64, 320), 9)
        llm.stop_profile()
        traces = sorted(glob.glob(os.path.join(args.profile_dir, "*.pt.trace.json.gz")))
        print("vLLM's steps (profiled: the profiler adds to every op):")
        _op_breakdown(max(traces, key=os.path.getmtime))


if __name__ == "__main__":  # vLLM starts its engine in spawned processes
    main()
