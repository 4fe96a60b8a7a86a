"""Dispatch microbenchmark: what it costs to hand one StepPlan to the TP workers.

    python -m kvray.bench.dispatch [--tp 2] [--steps 300] [--running 8] [--json PATH]

For a tiny random Llama checkpoint (written to a temporary directory) it times
`executor.wait(executor.submit(plan))` through

- `RayExecutor(compiled=True)`: a Ray Compiled Graph (shared-memory channels),
- `RayExecutor(compiled=False)`: plain actor calls, one per rank,
- `LocalExecutor`: the worker in this process (TP 1: the baseline with no dispatch),

for two kinds of plan: an empty plan (the workers apply no delta and compute nothing, so
this is the dispatch round trip alone) and a steady decode step of `--running` requests
(rows, starts, one out_loc slot each, built by the real scheduler; the time includes the
tiny model's forward pass and, over Ray, its gloo collectives). Every executor is warmed up
first (a compiled graph's first few hundred executions are slow). The in-process worker
runs with the torch thread budget of one Ray rank (`cpu_count // tp`, or `--threads`).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvray.bench.tiny import write_tiny_checkpoint
from kvray.core import SamplingParams, StepPlan


def write_tiny_llama(path: str | Path, seed: int = 0, tokenizer: bool = False, **overrides: Any):
    """A tiny random 2-layer Llama with tied embeddings (see `kvray.bench.tiny`)."""
    layout = {"num_hidden_layers": 2, "tie_word_embeddings": True, **overrides}
    return write_tiny_checkpoint(path, "llama", seed, tokenizer, **layout)


# -- the benchmark --------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    mean_us: float
    p50_us: float
    p99_us: float

    @classmethod
    def of(cls, ns: list[int]) -> Timing:
        us = sorted(t / 1e3 for t in ns)
        p99 = us[min(int(len(us) * 0.99), len(us) - 1)]
        return cls(statistics.fmean(us), us[len(us) // 2], p99)


@dataclass(frozen=True)
class DispatchResult:
    executor: str  # "compiled" | "actor_calls" | "in_process"
    tp: int
    steps: int
    empty: Timing  # an empty plan: the dispatch round trip alone
    decode: Timing  # a decode step of `running` requests (includes the forward pass)


def empty_plan(step_id: int = 0) -> StepPlan:
    z = np.zeros(0, dtype=np.int32)
    return StepPlan(step_id, z, z, z, z, z, z, np.zeros(0, dtype=bool))


def _prompts(running: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, prompt_len).tolist() for _ in range(running)]


def _time(fn: Callable[[], Any], n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def bench_executor(
    name: str,
    make_executor: Callable[[], Any],
    spec: Any,
    tp: int,
    steps: int,
    warmup: int,
    running: int,
    prompt_len: int,
) -> tuple[DispatchResult, int]:
    """Time one executor; returns the result and the decode plan's pickled size."""
    from kvray.scheduler import Scheduler

    ex = make_executor()
    try:
        sched = Scheduler(spec.scheduler_config(), spec.eos_token_ids, seed=0)
        sp = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 8, ignore_eos=True)
        for rid, ids in enumerate(_prompts(running, prompt_len, spec.vocab_size)):
            sched.add_request(rid, ids, sp)

        def step() -> StepPlan:
            plan = sched.step()
            assert plan is not None
            sched.process_result(ex.wait(ex.submit(plan)))
            return plan

        while sched.waiting or any(r.prefilling for r in sched.running):
            step()  # prefill: reach steady decode
        plan = empty_plan()
        for _ in range(warmup):
            ex.wait(ex.submit(plan))
        for _ in range(min(warmup, 32)):
            step()
        empty = _time(lambda: ex.wait(ex.submit(plan)), steps)

        decode: list[int] = []
        plan_bytes = 0
        for _ in range(steps):
            p = sched.step()
            assert p is not None and p.batch_size == running and p.fill_ids.size == 0
            plan_bytes = len(pickle.dumps(p))
            t0 = time.perf_counter_ns()
            result = ex.wait(ex.submit(p))
            decode.append(time.perf_counter_ns() - t0)
            sched.process_result(result)
        sched.check_integrity()
        return DispatchResult(name, tp, steps, Timing.of(empty), Timing.of(decode)), plan_bytes
    finally:
        ex.shutdown()


def run(
    tp: int = 2,
    steps: int = 300,
    warmup: int = 500,
    running: int = 8,
    prompt_len: int = 32,
    model_dir: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    import ray
    import torch

    from kvray.cluster.executor import LocalExecutor
    from kvray.cluster.ray_executor import RayExecutor
    from kvray.cluster.spec import EngineSpec
    from kvray.config import EngineConfig

    max_seq_len = prompt_len + warmup + steps + 64
    # RayExecutor gives each CPU rank cpu_count // tp torch threads; the in-process worker
    # gets the same, so the decode rows compare like with like (and an oversubscribed
    # machine does not turn the in-process row into a measure of OpenMP spin-waits).
    threads = threads or max(1, (os.cpu_count() or 1) // tp)
    page_size = 16
    with tempfile.TemporaryDirectory(prefix="kvray-dispatch-") as tmp:
        path = model_dir or tmp
        if model_dir is None:
            write_tiny_llama(path, max_position_embeddings=max_seq_len)

        def spec_for(tp_size: int):
            cfg = EngineConfig(
                model=str(path),
                tp_size=tp_size,
                dtype="float32",
                page_size=page_size,
                num_pages=running * (max_seq_len // page_size + 2),
                max_running_reqs=running,
                max_prefill_tokens=running * prompt_len,
                max_seq_len=max_seq_len,
            )
            return EngineSpec.resolve(cfg, progress=False)

        started = not ray.is_initialized()
        if started:
            ray.init(
                num_cpus=max(tp, os.cpu_count() or 1),
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        try:
            spec = spec_for(tp)
            wspec = spec.worker_spec("cpu")
            runs: list[tuple[str, Callable[[], Any], Any, int]] = [
                ("compiled", lambda: RayExecutor(wspec, tp, compiled=True), spec, tp),
                ("actor_calls", lambda: RayExecutor(wspec, tp, compiled=False), spec, tp),
            ]
            local_spec = spec_for(1)
            runs.append(
                ("in_process", lambda: LocalExecutor(local_spec.worker_spec("cpu")), local_spec, 1)
            )
            results = []
            plan_bytes = 0
            torch_threads = torch.get_num_threads()
            for name, make, s, t in runs:
                if name == "in_process":  # the same thread budget as one Ray rank
                    torch.set_num_threads(threads)
                try:
                    r, plan_bytes = bench_executor(
                        name, make, s, t, steps, warmup, running, prompt_len
                    )
                finally:
                    torch.set_num_threads(torch_threads)
                results.append(r)
        finally:
            if started:
                ray.shutdown()

    base = {r.executor: r for r in results}["in_process"]
    summary: dict[str, Any] = {
        "tp": tp,
        "running": running,
        "in_process_threads": threads,
        "decode_plan_bytes": plan_bytes,
        "empty_plan_bytes": len(pickle.dumps(empty_plan())),
    }
    for r in results:
        summary[f"{r.executor}_empty_p50_us"] = round(r.empty.p50_us, 1)
        summary[f"{r.executor}_decode_p50_us"] = round(r.decode.p50_us, 1)
        if r.executor != "in_process":
            summary[f"{r.executor}_dispatch_overhead_us"] = round(
                r.empty.p50_us - base.empty.p50_us, 1
            )
    return {
        "summary": summary,
        "config": dict(
            tp=tp,
            steps=steps,
            warmup=warmup,
            running=running,
            prompt_len=prompt_len,
            in_process_threads=threads,
        ),
        "results": [asdict(r) for r in results],
    }


LABELS = {
    "compiled": "Ray Compiled Graph",
    "actor_calls": "Ray actor calls",
    "in_process": "in-process",
}


def format_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"per-step dispatch (submit + wait), tiny Llama, {s['running']} running requests; "
        f"decode plan {s['decode_plan_bytes']} B pickled, empty plan {s['empty_plan_bytes']} B; "
        f"in-process with {s['in_process_threads']} torch thread(s), like one Ray rank",
        f"{'executor':<20} {'tp':>2} {'empty p50 us':>12} {'empty mean':>10} "
        f"{'decode p50 us':>13} {'decode mean':>11} {'decode p99':>10}",
    ]
    for r in report["results"]:
        e, d = r["empty"], r["decode"]
        lines.append(
            f"{LABELS[r['executor']]:<20} {r['tp']:>2} {e['p50_us']:>12.1f} {e['mean_us']:>10.1f} "
            f"{d['p50_us']:>13.1f} {d['mean_us']:>11.1f} {d['p99_us']:>10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench dispatch",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300, help="timed plans of each kind")
    ap.add_argument("--warmup", type=int, default=500, help="untimed empty plans first")
    ap.add_argument("--running", type=int, default=8, help="requests in the decode batch")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--model", help="a checkpoint dir (default: a tiny random Llama)")
    ap.add_argument(
        "--threads", type=int, help="torch threads in process (default: cpu_count // tp)"
    )
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    report = run(
        args.tp, args.steps, args.warmup, args.running, args.prompt_len, args.model, args.threads
    )
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
