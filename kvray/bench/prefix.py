"""Prefix-sharing benchmark: the radix cache against the naive cache on shared system prompts.
(With `--replicas N`: the request routers across N engine replicas, kvray.bench.routing.)

    python -m kvray.bench.prefix [--groups 8] [--per-group 16] [--prefix-len 1024]
                                 [--suffix-len 32] [--output-len 32] [--json PATH]

The workload: `--groups` long system prompts (`--prefix-len` random token ids each, seeded,
no special tokens), each shared by `--per-group` requests that add a distinct
`--suffix-len`-token tail and ask for `--output-len` tokens (greedy, ignore_eos). Groups
are interleaved in submission order, as independent clients would send them.

The same workload runs through two fresh in-process engines (`LocalEngine`, TP 1), first
with the radix prefix cache and then with the naive one, with the same torch threads and a
KV pool big enough for every request at once (so nothing is preempted). All requests are
queued at t0 and driven with `engine.step()` until done. Measured per cache policy:

- prefill tokens computed (`scheduler.stats.prefill_tokens`),
- TTFT of every request (its first token event - t0): p50 / p99,
- output throughput (output tokens / wall time) and the total wall time.

The lowest prefill ratio radix/naive the workload allows is
(groups x prefix + requests x suffix) / (requests x (prefix + suffix)): every group's
prefix computed once, every suffix once. The default 32-token suffix (a short user turn
after a long system prompt) puts that floor at 0.091; with a 64-token suffix it is 0.118,
so no cache could compute under 10% of the naive prefill there.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvray.bench.report import (
    DTYPE_HELP,
    default_dtype,
    machine_info,
    print_table,
    write_bars,
    write_json,
)
from kvray.core import SamplingParams

POLICIES = ("radix", "naive")


@dataclass(frozen=True)
class Workload:
    groups: int = 8
    per_group: int = 16
    prefix_len: int = 1024
    suffix_len: int = 32
    output_len: int = 32
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return self.groups * self.per_group

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len

    @property
    def prefill_floor(self) -> float:
        """The lowest radix/naive prefill ratio: each prefix once, each suffix once."""
        shared = self.groups * self.prefix_len + self.num_requests * self.suffix_len
        return shared / (self.num_requests * (self.prefix_len + self.suffix_len))

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Prompts in submission order (groups interleaved). Ids avoid the low and high
        ends of the vocabulary, where tokenizers keep their special tokens."""
        lo, hi = _id_range(vocab_size)
        rng = np.random.default_rng(self.seed)
        prefixes = [rng.integers(lo, hi, self.prefix_len).tolist() for _ in range(self.groups)]
        out = []
        for _ in range(self.per_group):
            for g in range(self.groups):
                out.append(prefixes[g] + rng.integers(lo, hi, self.suffix_len).tolist())
        return out


@dataclass
class PolicyResult:
    policy: str
    num_requests: int
    prefill_tokens: int
    prefix_hit_tokens: int
    output_tokens: int
    total_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    e2e_p50_s: float
    steps: int
    ttft_s: list[float] = field(default_factory=list)  # per request, submission order
    cached_tokens: list[int] = field(default_factory=list)  # per request, from the cache


def _id_range(vocab_size: int) -> tuple[int, int]:
    """Token ids [lo, hi) for random prompts: [100, vocab - 100), or [1, vocab) for a tiny
    test vocabulary."""
    lo, hi = 100, vocab_size - 100
    return (lo, hi) if hi - lo >= 100 else (1, vocab_size)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _engine_config(args: argparse.Namespace, w: Workload, policy: str) -> Any:
    from kvray.config import EngineConfig

    ps = args.page_size
    pages = args.num_pages or w.num_requests * (-(-w.seq_len // ps) + 1) + 16
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        page_size=ps,
        num_pages=pages,
        cache_policy=policy,
        max_running_reqs=max(w.num_requests, 1),
        max_prefill_tokens=args.max_prefill_tokens,
        max_seq_len=w.seq_len,
        attention_backend=args.attention_backend,
        seed=w.seed,
    )


def _warm_up(engine: Any, vocab_size: int) -> None:
    """One short request with its own tokens: first-call costs (allocator, kernels) are
    paid before t0. Its counters are subtracted and the cache is flushed after it."""
    n = max(1, min(48, engine.scheduler.max_seq_len - 2))
    ids = np.random.default_rng(12345).integers(*_id_range(vocab_size), n).tolist()
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_work:
        engine.step()
    engine.flush_cache()


def run_policy(
    policy: str, args: argparse.Namespace, w: Workload, progress: bool = True
) -> PolicyResult:
    from tqdm import tqdm

    from kvray.cluster.local import LocalEngine
    from kvray.cluster.spec import EngineSpec

    config = _engine_config(args, w, policy)
    spec = EngineSpec.resolve(config, progress=progress, device=args.device)
    engine = LocalEngine(config, spec, device=args.device)
    try:
        prompts = w.prompts(spec.vocab_size)
        if args.warmup:
            _warm_up(engine, spec.vocab_size)
        stats = engine.scheduler.stats
        prefill0, hit0, steps0 = stats.prefill_tokens, stats.prefix_hit_tokens, stats.steps
        sp = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)

        t0 = time.perf_counter()
        rids = [engine.add_request(ids, sp) for ids in prompts]
        index = {rid: i for i, rid in enumerate(rids)}
        ttft: list[float | None] = [None] * len(rids)
        cached = [0] * len(rids)
        e2e = [0.0] * len(rids)
        outputs = 0
        done = 0
        bar = tqdm(total=len(rids), desc=f"{policy:>5}", unit="req", disable=not progress)
        try:
            while engine.has_work:
                events = engine.step()
                now = time.perf_counter()
                for ev in events:
                    if ev.error is not None:
                        raise RuntimeError(f"request {ev.rid} failed: {ev.error}")
                    i = index[ev.rid]
                    if ev.token_id is not None:
                        outputs += 1
                        if ttft[i] is None:
                            ttft[i] = now - t0
                    if ev.finished:
                        cached[i] = ev.num_cached_tokens or 0
                        e2e[i] = now - t0
                        done += 1
                        bar.update(1)
        finally:
            bar.close()
        total = time.perf_counter() - t0
        if done != len(rids) or any(t is None for t in ttft):
            raise RuntimeError(f"{policy}: {done} of {len(rids)} requests finished")
        engine.check_integrity()
        stats = engine.scheduler.stats
        ttfts = [float(t) for t in ttft if t is not None]
        return PolicyResult(
            policy=policy,
            num_requests=len(rids),
            prefill_tokens=stats.prefill_tokens - prefill0,
            prefix_hit_tokens=stats.prefix_hit_tokens - hit0,
            output_tokens=outputs,
            total_s=total,
            output_tok_s=outputs / total,
            ttft_p50_s=_pct(ttfts, 50),
            ttft_p99_s=_pct(ttfts, 99),
            ttft_mean_s=float(np.mean(ttfts)),
            e2e_p50_s=_pct(e2e, 50),
            steps=stats.steps - steps0,
            ttft_s=ttfts,
            cached_tokens=cached,
        )
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    w = Workload(
        args.groups, args.per_group, args.prefix_len, args.suffix_len, args.output_len, args.seed
    )
    before = torch.get_num_threads()
    threads = args.threads or before
    results: dict[str, PolicyResult] = {}
    try:
        for policy in POLICIES:
            torch.set_num_threads(threads)  # the same thread budget for both
            results[policy] = run_policy(policy, args, w, progress=not args.no_progress)
        machine = machine_info()  # with the benchmark's torch threads
    finally:
        torch.set_num_threads(before)
    r, n = results["radix"], results["naive"]
    summary = {
        "radix_prefill_tokens": r.prefill_tokens,
        "naive_prefill_tokens": n.prefill_tokens,
        "prefill_ratio_radix_over_naive": r.prefill_tokens / max(n.prefill_tokens, 1),
        "prefill_ratio_floor": w.prefill_floor,
        "radix_ttft_p50_s": r.ttft_p50_s,
        "naive_ttft_p50_s": n.ttft_p50_s,
        "radix_ttft_p99_s": r.ttft_p99_s,
        "naive_ttft_p99_s": n.ttft_p99_s,
        "ttft_p50_ratio_naive_over_radix": n.ttft_p50_s / r.ttft_p50_s,
        "radix_output_tok_s": r.output_tok_s,
        "naive_output_tok_s": n.output_tok_s,
        "radix_total_s": r.total_s,
        "naive_total_s": n.total_s,
    }
    config = {
        **asdict(w),
        "num_requests": w.num_requests,
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "page_size": args.page_size,
        "num_pages": _engine_config(args, w, "radix").num_pages,
        "max_prefill_tokens": args.max_prefill_tokens,
        "attention_backend": args.attention_backend,
        "torch_threads": threads,
        "warmup": args.warmup,
    }
    return {
        "summary": summary,
        "config": config,
        "machine": machine,
        "results": {p: asdict(res) for p, res in results.items()},
    }


def print_report(report: dict[str, Any]) -> None:
    s, c = report["summary"], report["config"]
    res = report["results"]
    rows = [
        ["prefill tokens", s["radix_prefill_tokens"], s["naive_prefill_tokens"],
         s["prefill_ratio_radix_over_naive"], "radix/naive"],
        ["TTFT p50 (s)", s["radix_ttft_p50_s"], s["naive_ttft_p50_s"],
         s["ttft_p50_ratio_naive_over_radix"], "naive/radix"],
        ["TTFT p99 (s)", s["radix_ttft_p99_s"], s["naive_ttft_p99_s"],
         s["naive_ttft_p99_s"] / s["radix_ttft_p99_s"], "naive/radix"],
        ["E2E p50 (s)", res["radix"]["e2e_p50_s"], res["naive"]["e2e_p50_s"],
         res["naive"]["e2e_p50_s"] / res["radix"]["e2e_p50_s"], "naive/radix"],
        ["output tok/s", s["radix_output_tok_s"], s["naive_output_tok_s"],
         s["radix_output_tok_s"] / s["naive_output_tok_s"], "radix/naive"],
        ["total (s)", s["radix_total_s"], s["naive_total_s"],
         s["naive_total_s"] / s["radix_total_s"], "naive/radix"],
        ["prefix hit tokens", res["radix"]["prefix_hit_tokens"],
         res["naive"]["prefix_hit_tokens"], "", ""],
        ["steps", res["radix"]["steps"], res["naive"]["steps"], "", ""],
    ]  # fmt: skip
    print_table(
        f"prefix sharing: {c['groups']} groups x {c['per_group']} requests, "
        f"prefix {c['prefix_len']} + suffix {c['suffix_len']} tokens, {c['output_len']} out; "
        f"{c['model']}, {c['dtype']}, page {c['page_size']}, "
        f"{c['torch_threads']} torch thread(s)",
        ["metric", "radix", "naive", "ratio", "ratio of"],
        rows,
    )
    g, n, p, x = c["groups"], c["num_requests"], c["prefix_len"], c["suffix_len"]
    print(
        f"theoretical floor of the prefill ratio radix/naive: ({g} x {p} + {n} x {x}) / "
        f"({n} x ({p} + {x})) = {s['prefill_ratio_floor']:.4f}; "
        f"measured {s['prefill_ratio_radix_over_naive']:.4f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args_in = sys.argv[1:] if argv is None else argv
    if any(a == "--replicas" or a.startswith("--replicas=") for a in args_in):
        from kvray.bench import routing  # across replicas: the routers' benchmark

        return routing.main(args_in)
    from kvray.config import EngineConfig

    defaults = EngineConfig.model_fields  # the engine's own, where the bench keeps them
    ap = argparse.ArgumentParser(
        prog="kvray bench prefix",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    ap.add_argument("--per-group", type=int, default=16, help="requests per shared prefix")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=32, help="distinct tokens per request")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument(
        "--dtype",
        default=default_dtype(),
        choices=["auto", "float32", "bfloat16", "float16"],
        help=DTYPE_HELP,
    )
    ap.add_argument("--page-size", type=int, default=defaults["page_size"].default)
    ap.add_argument(
        "--num-pages", type=int, default=None, help="KV pages (default: every request at once)"
    )
    ap.add_argument(
        "--max-prefill-tokens", type=int, default=defaults["max_prefill_tokens"].default
    )
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the short untimed request each engine runs first",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--json", help="write the report here (and a PNG next to it)")
    args = ap.parse_args(argv)
    for name in ("groups", "per_group", "prefix_len", "output_len", "page_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.suffix_len < 1:
        ap.error("--suffix-len must be >= 1 (requests need distinct tails)")

    report = run(args)
    print_report(report)
    sys.stdout.flush()
    path = write_json(
        args.json, report["summary"], **{k: v for k, v in report.items() if k != "summary"}
    )
    s = report["summary"]
    png = write_bars(
        path,
        "prefix sharing: radix vs naive",
        {
            "prefill tokens": {
                "radix": s["radix_prefill_tokens"],
                "naive": s["naive_prefill_tokens"],
            },
            "TTFT p50 (s)": {"radix": s["radix_ttft_p50_s"], "naive": s["naive_ttft_p50_s"]},
            "TTFT p99 (s)": {"radix": s["radix_ttft_p99_s"], "naive": s["naive_ttft_p99_s"]},
            "output tok/s": {"radix": s["radix_output_tok_s"], "naive": s["naive_output_tok_s"]},
        },
        ylabel="value",
    )
    if path is not None:
        print(f"wrote {path}" + (f" and {png}" if png else ""))
    return report


if __name__ == "__main__":
    main()
