"""Scheduler microbenchmark: CPU time per decode step, no model.

    python -m kvray.bench.scheduler [--running 256] [--page-sizes 1 16] [--steps 500]

Fills the engine with `--running` requests (a shared system prompt plus a distinct
suffix, radix cache), runs them into steady decode, then times `step()` +
`process_result()` per step with an executor that returns tokens at once. What it
measures is everything the scheduler does per step, not the model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvray.config import SchedulerConfig
from kvray.core import SamplingParams, StepPlan, StepResult
from kvray.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerBenchResult:
    page_size: int
    cache_policy: str
    running: int
    steps: int
    mean_ms: float
    p50_ms: float
    p99_ms: float


def _instant(plan: StepPlan, rng: random.Random) -> StepResult:
    n = plan.num_samples
    tokens = np.fromiter((rng.randrange(1, 30000) for _ in range(n)), np.int32, count=n)
    return StepResult(plan.step_id, tokens, logprobs=np.zeros(n, dtype=np.float32))


def bench_decode(
    page_size: int,
    running: int = 256,
    steps: int = 500,
    policy: str = "radix",
    prompt_len: int = 128,
    seed: int = 0,
) -> SchedulerBenchResult:
    rng = random.Random(seed)
    max_seq_len = prompt_len + steps + 64
    cfg = SchedulerConfig(
        num_pages=running * (max_seq_len // page_size + 2),
        page_size=page_size,
        max_running_reqs=running,
        max_prefill_tokens=8192,
        max_seq_len=max_seq_len,
        cache_policy=policy,
    )
    sched = Scheduler(cfg, eos_token_ids=[0])
    system = [rng.randrange(1, 30000) for _ in range(prompt_len // 2)]
    for rid in range(running):
        suffix = [rng.randrange(1, 30000) for _ in range(prompt_len - len(system))]
        sp = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
        sched.add_request(rid, system + suffix, sp)
    while any(r.prefilling for r in sched.running) or sched.waiting:  # reach steady decode
        sched.process_result(_instant(sched.step(), rng))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.step()
        t1 = time.perf_counter()
        result = _instant(plan, rng)  # the "model": not scheduler time
        t2 = time.perf_counter()
        sched.process_result(result)
        t3 = time.perf_counter()
        assert plan.batch_size == running
        times.append((t1 - t0) + (t3 - t2))
    sched.check_integrity()
    ms = [t * 1e3 for t in times]
    ms.sort()
    return SchedulerBenchResult(
        page_size,
        policy,
        running,
        steps,
        mean_ms=statistics.fmean(ms),
        p50_ms=ms[len(ms) // 2],
        p99_ms=ms[int(len(ms) * 0.99)],
    )


def main(argv: list[str] | None = None) -> list[SchedulerBenchResult]:
    ap = argparse.ArgumentParser(
        prog="kvray bench scheduler",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--cache", choices=["radix", "naive"], default="radix")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = [bench_decode(ps, args.running, args.steps, args.cache) for ps in args.page_sizes]
    print(f"scheduler CPU time per decode step ({args.running} running, {args.cache} cache)")
    print(f"{'page_size':>9} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for r in results:
        print(f"{r.page_size:>9} {r.mean_ms:>8.3f} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "summary": {f"ps{r.page_size}_mean_ms": r.mean_ms for r in results},
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return results


if __name__ == "__main__":
    main()
