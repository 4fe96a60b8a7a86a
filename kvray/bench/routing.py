"""Routing benchmark: request routers of a multi-replica app on a multi-turn workload.

    kvray bench prefix --replicas 2 [--router round-robin pow2 prefix] [--share-kv]
                       [--conversations 11]
                       [--turns 6] [--opening-len 1024] [--user-len 64] [--output-len 128]
                       [--json PATH]

The workload: `--conversations` chats, each opening with its own `--opening-len` random
token ids; every turn resends the whole history (the opening, every earlier reply and user
message) plus a new `--user-len`-token user message and asks for `--output-len` tokens
(greedy, ignore_eos). Conversation c starts at c x `--stagger-s` and sends each next
turn `--think-s` after its reply is in (a user reading and typing), so turns of different
conversations arrive interleaved, as from independent clients.

For each router the app is started fresh on a local Ray cluster (`--replicas` engine
replicas, TP 1) and the workload runs through the engine deployment's handle, so Serve's
routing (the router under test, in this process) picks every request's replica; tokens
stream straight from the engines, as the HTTP ingress reads them. A single replica (the
ideal: one cache holds every conversation) runs the same workload first. Measured per
router: prefill tokens computed over all engines, prefix-cache hit rate (hit / looked-up
prompt tokens), TTFT p50 / p99 (submit to first token; p50 also over follow-up turns
only), output tokens/s.

With `--share-kv`, a second comparison: two-turn conversations whose follow-up is routed
away from the replica holding the conversation (`AwayRouter`: the replica holding the
least of the prompt), which either recomputes the history or, with --share-kv, fetches
its K/V from the holder (kvray.cluster.kv_transfer); follow-up TTFT p50 side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass, replace
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
from kvray.deploy.router import EngineFollowingRouter, token_ids

ROUTERS = ("round-robin", "pow2", "prefix")
APP = "kvray-bench-routing"


@dataclass(frozen=True)
class Workload:
    conversations: int = 11  # odd: round-robin moves a conversation at every turn
    turns: int = 6
    opening_len: int = 1024
    user_len: int = 64  # chat: short user turns, longer replies
    output_len: int = 128
    think_s: float = 1.0  # a user's pause between a reply and the next turn
    stagger_s: float = 0.5  # conversation c starts at c x this
    seed: int = 0

    def max_len(self) -> int:
        return self.opening_len + self.turns * (self.user_len + self.output_len)


@dataclass
class RouterResult:
    router: str
    replicas: int
    prefill_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    fetched_tokens: int  # prompt tokens whose K/V came from another replica (--share-kv)
    fetches: int
    fetch_failures: int
    fetch_seconds_mean: float
    ttft_p50_s: float
    ttft_p99_s: float
    follow_up_ttft_p50_s: float  # turns after the first
    output_tok_s: float
    total_s: float
    requests: int
    decisions: dict[str, int]  # the prefix router's, in this process (kvray.deploy.metrics)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_query_tokens, 1)


def _engine_stats(app: str) -> list[dict[str, Any]]:
    from kvray.deploy.app import engine_stats

    return engine_stats(app)


async def _conversation(
    client: Any, w: Workload, c: int, rng: np.random.Generator, ttfts: list[tuple[int, float]]
) -> int:
    lo, hi = 100, 40_000
    history = rng.integers(lo, hi, w.opening_len).tolist()
    sampling = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
    out = 0
    await asyncio.sleep(c * w.stagger_s)
    for turn in range(w.turns):
        if turn:
            await asyncio.sleep(w.think_s)
        prompt = history + rng.integers(lo, hi, w.user_len).tolist()
        start = time.perf_counter()
        stream = await client.generate(prompt, sampling)
        reply: list[int] = []
        async for events in stream:
            for ev in events:
                if ev.error is not None:
                    raise RuntimeError(f"conversation {c}: {ev.error}")
                if ev.token_id is not None:
                    if not reply:
                        ttfts.append((turn, time.perf_counter() - start))
                    reply.append(ev.token_id)
        out += len(reply)
        history = prompt + reply
    return out


class AwayRouter(EngineFollowingRouter):
    """Routing forced away from the holder: each request to the replica holding the least
    of its prompt (ties: the less loaded), so a follow-up never lands where its
    conversation is cached. With `share_kv` that replica fetches the prefix."""

    async def choose_replicas(
        self,
        candidate_replicas: list[Any],
        pending_request: Any = None,
    ) -> list[list[Any]]:
        if not candidate_replicas:
            return []
        ids = token_ids(pending_request)
        if ids is None:
            return [candidate_replicas]
        keys, matched = self._matches(ids, candidate_replicas)
        ranked = sorted(
            candidate_replicas, key=lambda r: (matched[r.replica_id], self._load(r.replica_id))
        )
        self._routed(pending_request, ranked[0], keys, matched)
        return [[ranked[0]], ranked[1:]]


def run_router(
    router: str, replicas: int, args: argparse.Namespace, w: Workload, share_kv: bool = False
) -> RouterResult:
    from ray import serve

    from kvray.deploy.app import ServeEngineClient, build_app
    from kvray.deploy.settings import ServeConfig

    # An app of its own per run: this process keeps a deployment's handle (and its router)
    # by name across apps.
    app = f"{APP}-{router}-{replicas}{'-share-kv' if share_kv else ''}"
    settings = ServeConfig(
        model=args.model,
        dtype=args.dtype,
        replicas=replicas,
        router=router if router != "away" else "prefix",
        share_kv=share_kv,
        share_kv_min_tokens=args.share_kv_min_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        app_name=app,
    ).resolved()
    what = f"{router}{' + share-kv' if share_kv else ''} x {replicas} replica(s)"
    print(f"[bench] {what}: starting", file=sys.stderr, flush=True)
    request_router = None
    if router == "away":
        from ray.serve.config import RequestRouterConfig

        request_router = RequestRouterConfig(
            request_router_class=AwayRouter,
            request_router_kwargs={
                "app_name": app,
                "page_size": args.page_size,
                "share_kv": share_kv,
                "share_kv_min_tokens": args.share_kv_min_tokens,
            },
        )
        settings = settings.model_copy(update={"router": "prefix"})  # (replaced)
    serve.run(build_app(settings, request_router), name=app, route_prefix=None)
    try:
        handle = serve.get_deployment_handle("EngineDeployment", app)
        client = ServeEngineClient(handle)

        async def drive() -> tuple[int, list[tuple[int, float]], float]:
            ttfts: list[tuple[int, float]] = []
            rng = [np.random.default_rng((w.seed, c)) for c in range(w.conversations)]
            start = time.perf_counter()
            outs = await asyncio.gather(
                *(_conversation(client, w, c, rng[c], ttfts) for c in range(w.conversations))
            )
            return sum(outs), ttfts, time.perf_counter() - start

        from kvray.deploy import metrics

        before, decisions0 = _engine_stats(app), dict(metrics.ROUTER_STATS)
        out_tokens, ttfts, total = asyncio.run(drive())
        after = _engine_stats(app)
        decisions = {
            k: v - decisions0.get(k, 0)
            for k, v in metrics.ROUTER_STATS.items()
            if v != decisions0.get(k, 0)
        }
    finally:
        serve.delete(app)

    def moved(key: str) -> Any:
        return sum(s[key] for s in after) - sum(s[key] for s in before)

    return RouterResult(
        router=router + (" + share-kv" if share_kv else ""),
        replicas=replicas,
        prefill_tokens=moved("prefill_tokens"),
        prefix_query_tokens=moved("prefix_query_tokens"),
        prefix_hit_tokens=moved("prefix_hit_tokens"),
        fetched_tokens=moved("kv_fetched_tokens"),
        fetches=moved("kv_fetches"),
        fetch_failures=moved("kv_fetch_failures"),
        fetch_seconds_mean=moved("kv_fetch_seconds_sum") / max(moved("kv_fetches"), 1),
        ttft_p50_s=float(np.percentile([t for _, t in ttfts], 50)),
        ttft_p99_s=float(np.percentile([t for _, t in ttfts], 99)),
        follow_up_ttft_p50_s=float(np.percentile([t for turn, t in ttfts if turn] or [0.0], 50)),
        output_tok_s=out_tokens / total,
        total_s=total,
        requests=len(ttfts),
        decisions=decisions,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    w = Workload(
        args.conversations,
        args.turns,
        args.opening_len,
        args.user_len,
        args.output_len,
        args.think_s,
        args.stagger_s,
        args.seed,
    )
    if not ray.is_initialized():
        ray.init(num_cpus=max(8, 2 * args.replicas), include_dashboard=False)
    results = {"single": run_router("pow2", 1, args, w)}
    for router in args.router:
        results[router] = run_router(router, args.replicas, args, w)
    # --share-kv: every follow-up forced away from the replica holding its conversation,
    # which recomputes it or fetches it. Two turns: the first caches the history somewhere,
    # the second (measured) lands elsewhere.
    away = {}
    if args.share_kv:
        w2 = replace(w, turns=2)
        away["recompute"] = run_router("away", args.replicas, args, w2)
        away["share-kv"] = run_router("away", args.replicas, args, w2, True)
    ideal = results["single"].prefill_tokens
    summary = {}
    for name, r in results.items():
        summary[f"{name}_prefill_tokens"] = r.prefill_tokens
        summary[f"{name}_prefill_over_single"] = r.prefill_tokens / max(ideal, 1)
        summary[f"{name}_ttft_p50_s"] = r.ttft_p50_s
        summary[f"{name}_hit_rate"] = r.hit_rate
    if "prefix" in results and "round-robin" in results:
        summary["ttft_p50_ratio_round_robin_over_prefix"] = (
            results["round-robin"].ttft_p50_s / results["prefix"].ttft_p50_s
        )
    if away:
        summary["away_follow_up_ttft_p50_s_recompute"] = away["recompute"].follow_up_ttft_p50_s
        summary["away_follow_up_ttft_p50_s_share_kv"] = away["share-kv"].follow_up_ttft_p50_s
        summary["ttft_p50_ratio_recompute_over_share_kv"] = (
            away["recompute"].follow_up_ttft_p50_s / away["share-kv"].follow_up_ttft_p50_s
        )
    return {
        "summary": summary,
        "config": {
            **asdict(w),
            "replicas": args.replicas,
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "dtype": args.dtype,
            "page_size": args.page_size,
        },
        "machine": machine_info(),
        "results": {k: {**asdict(r), "hit_rate": r.hit_rate} for k, r in results.items()},
        "away": {k: {**asdict(r), "hit_rate": r.hit_rate} for k, r in away.items()},
    }


def print_report(report: dict[str, Any]) -> None:
    c, res = report["config"], report["results"]
    ideal = res["single"]["prefill_tokens"]
    rows = []
    for name, r in res.items():
        label = "1 replica (ideal)" if name == "single" else f"{name} x {r['replicas']}"
        rows.append(
            [
                label,
                r["prefill_tokens"],
                r["prefill_tokens"] / max(ideal, 1),
                r["hit_rate"],
                r["fetched_tokens"],
                r["ttft_p50_s"],
                r["follow_up_ttft_p50_s"],
                r["ttft_p99_s"],
                r["output_tok_s"],
            ]
        )
    print_table(
        f"routing: {c['conversations']} conversations x {c['turns']} turns, opening "
        f"{c['opening_len']} + {c['user_len']} per user turn, {c['output_len']} out; "
        f"{c['model']}, {c['dtype']}, page {c['page_size']}",
        [
            "router",
            "prefill tokens",
            "/ ideal",
            "prefix hit rate",
            "K/V fetched",
            "TTFT p50 (s)",
            "follow-ups p50",
            "TTFT p99 (s)",
            "out tok/s",
        ],
        rows,
    )
    for name, r in res.items():
        if r["decisions"]:
            print(
                f"{name}: router counts {r['decisions']}, fetches {r['fetches']} "
                f"(failed {r['fetch_failures']}, mean {r['fetch_seconds_mean'] * 1e3:.0f} ms)"
            )
    if "ttft_p50_ratio_round_robin_over_prefix" in report["summary"]:
        ratio = report["summary"]["ttft_p50_ratio_round_robin_over_prefix"]
        print(f"TTFT p50 round-robin / prefix: {ratio:.2f}x")
    away = report["away"]
    if away:
        print_table(
            f"--share-kv: {c['conversations']} conversations x 2 turns, every follow-up "
            "routed away from the replica holding its conversation",
            ["follow-up", "prefill tokens", "K/V fetched", "fetches (failed)", "fetch mean (ms)",
             "follow-up TTFT p50 (s)", "TTFT p99 (s)"],
            [
                [name, r["prefill_tokens"], r["fetched_tokens"],
                 f"{r['fetches']} ({r['fetch_failures']})", r["fetch_seconds_mean"] * 1e3,
                 r["follow_up_ttft_p50_s"], r["ttft_p99_s"]]
                for name, r in away.items()
            ],
        )  # fmt: skip
        ratio = report["summary"]["ttft_p50_ratio_recompute_over_share_kv"]
        print(f"follow-up TTFT p50 away from the holder, recomputing / fetching K/V: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench routing",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--router", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument(
        "--share-kv",
        action="store_true",
        help="also compare, with every follow-up routed away from the replica holding its "
        "conversation, recomputing it against fetching its K/V (--share-kv)",
    )
    ap.add_argument(
        "--share-kv-min-tokens",
        type=int,
        default=64,
        help="with --share-kv: the least gain worth a fetch (the server's default is 256)",
    )
    ap.add_argument("--think-s", type=float, default=1.0, help="pause before each next turn")
    ap.add_argument("--stagger-s", type=float, default=0.5, help="between conversation starts")
    ap.add_argument("--conversations", type=int, default=11)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--opening-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument(
        "--dtype", default=default_dtype(), choices=["float32", "bfloat16"], help=DTYPE_HELP
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages per engine")
    ap.add_argument("--json", default=None, help="write the report here (and a .png plot)")
    args = ap.parse_args(argv)
    if args.num_pages is None:  # every conversation's whole history fits in one engine
        w = Workload(
            args.conversations, args.turns, args.opening_len, args.user_len, args.output_len
        )
        args.num_pages = args.conversations * (w.max_len() // args.page_size + 2) + 64
    report = run(args)
    print_report(report)
    sections = {k: v for k, v in report.items() if k != "summary"}
    path = write_json(args.json, report["summary"], **sections)
    res = report["results"]
    ideal = max(1, res["single"]["prefill_tokens"])
    write_bars(
        path,
        "routers on a multi-turn workload",
        {
            "prefill tokens / ideal": {k: r["prefill_tokens"] / ideal for k, r in res.items()},
            "TTFT p50 (s)": {k: r["ttft_p50_s"] for k, r in res.items()},
            "output tok/s": {k: r["output_tok_s"] for k, r in res.items()},
        },
        "",
    )
    return report
