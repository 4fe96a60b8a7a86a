"""Soak: many concurrent clients against a real kvray Serve app, some cut mid-request.

    kvray bench soak [--requests 2000] [--concurrency 64] [--json PATH]

Starts the kvray Serve application the way `kvray serve` does (its own local Ray cluster,
real HTTP on 127.0.0.1), then sends `--requests` requests from `--concurrency` clients:
completions and chat, streamed and not, prompts of mixed lengths, most of them sharing one
of a few long prefixes (so the radix cache is hit and evicts), `ignore_eos` with a random
`max_tokens`. A fraction (`--disconnect`) is cut at a random point (a streamed one after a
random number of events, a whole one after a random delay), and a few (`--bad`) are
malformed bodies, which must get a 400.

Afterwards, and only then, the report's checks:
- errors: requests that were not cut and did not get exactly what they asked for
  (status, `finish_reason`, token count, SSE framing), and bad bodies not refused with 400;
- `/metrics`: running and waiting gauges at 0, KV-cache usage back to its idle value;
- the engine: `check_integrity()` passes, and with the prefix cache flushed every page is
  free (`pages_leaked` counts the ones that are not);
- memory: the resident set of each of the app's processes (the Serve replicas, the
  scheduler and worker actors, the HTTP proxy), mean over the first quarter of the
  requests against the mean over the last quarter.

Exit status 0 when every check holds. `--json` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvray.net import free_port

APP_NAME = "kvray-soak"
BAD_BODIES: tuple[bytes, ...] = (
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": [[["nested"]]], "max_tokens": 2}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": 7}]}',
    b'{"messages": [',
)
WORDS = (
    "river stone cloud lantern orbit maple quiet signal harbor copper meadow violet engine "
    "candle window garden thunder pencil marble ladder"
).split()


@dataclass
class SoakConfig:
    requests: int = 240
    concurrency: int = 16
    disconnect: float = 0.2
    bad: float = 0.05
    prefixes: int = 4
    max_tokens: tuple[int, int] = (4, 48)
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    bad_bodies: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    idle_kv_usage: float = 0.0
    final_kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    integrity_ok: bool | None = None
    pages_leaked: int | None = None
    rss_mb_first_quarter: dict[str, float] = field(default_factory=dict)
    rss_mb_last_quarter: dict[str, float] = field(default_factory=dict)
    rss_growth_mb: dict[str, float] = field(default_factory=dict)
    rss_timeline: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(message[:300])


# -- the workload -----------------------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class _Job:
    index: int
    path: str
    body: dict[str, Any] | bytes
    cut_after: int | None  # SSE events to read before going away; -1: a whole one cut by time
    max_tokens: int


def plan(cfg: SoakConfig) -> list[_Job]:
    rng = random.Random(cfg.seed)
    prefixes = [_text(rng, rng.randint(150, 300)) for _ in range(cfg.prefixes)]
    jobs = []
    for i in range(cfg.requests):
        if rng.random() < cfg.bad:
            jobs.append(_Job(i, rng.choice(("/v1/completions", "/v1/chat/completions")),
                             rng.choice(BAD_BODIES), None, 0))  # fmt: skip
            continue
        shared = prefixes[i % cfg.prefixes] + " " if rng.random() < 0.8 else ""
        prompt = shared + _text(rng, rng.randint(2, 60))
        max_tokens = rng.randint(*cfg.max_tokens)
        stream = rng.random() < 0.6
        body: dict[str, Any] = {
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": rng.choice((0.0, 0.8)),
            "seed": i,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            path, body["prompt"] = "/v1/completions", prompt
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        cut = None
        if rng.random() < cfg.disconnect:
            cut = rng.randint(1, max_tokens) if stream else -1
        jobs.append(_Job(i, path, body, cut, max_tokens))
    return jobs


async def _one(client: httpx.AsyncClient, job: _Job, report: SoakReport) -> None:
    if isinstance(job.body, bytes):
        report.bad_bodies += 1
        r = await client.post(job.path, content=job.body)
        if r.status_code != 400 or "error" not in r.json():
            report.error(f"bad body {job.body[:40]!r}: {r.status_code} {r.text[:120]}")
        return
    if job.cut_after == -1:  # a whole response the client stops waiting for
        report.disconnects += 1
        task = asyncio.ensure_future(client.post(job.path, json=job.body))
        await asyncio.sleep(random.Random(job.index).uniform(0.05, 1.5))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        return
    if job.body["stream"]:
        await _streamed(client, job, report)
        return
    r = await client.post(job.path, json=job.body)
    if r.status_code != 200:
        report.error(f"#{job.index}: {r.status_code} {r.text[:200]}")
        return
    out = r.json()
    choice = out["choices"][0]
    if choice["finish_reason"] != "length" or out["usage"]["completion_tokens"] != job.max_tokens:
        report.error(f"#{job.index}: {choice['finish_reason']} {out['usage']}")


async def _streamed(client: httpx.AsyncClient, job: _Job, report: SoakReport) -> None:
    events: list[str] = []
    async with client.stream("POST", job.path, json=job.body) as r:
        if r.status_code != 200:
            report.error(f"#{job.index}: {r.status_code} {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line:
                continue
            events.append(line)
            if job.cut_after is not None and len(events) >= job.cut_after:
                report.disconnects += 1
                return  # leaving the block closes the connection mid-stream
    if job.cut_after is not None:
        report.disconnects += 1  # it ended before the cut point: still counted as cut
        return
    if not events or events[-1] != "data: [DONE]":
        report.error(f"#{job.index}: stream did not end with [DONE]: {events[-1:]}")
        return
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    if any("error" in p for p in payloads):
        report.error(f"#{job.index}: error event {payloads[-1]}")
        return
    usage = payloads[-1].get("usage") or {}
    reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    if reasons != ["length"] or usage.get("completion_tokens") != job.max_tokens:
        report.error(f"#{job.index}: finish {reasons}, usage {usage}")


async def drive(base_url: str, cfg: SoakConfig, report: SoakReport, progress: list[int]) -> None:
    jobs = plan(cfg)
    queue: asyncio.Queue[_Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    report.requests = len(jobs)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=limits, trust_env=False
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                job = queue.get_nowait()
                try:
                    await _one(client, job, report)
                except Exception as e:  # noqa: BLE001 - every failure is a counted error
                    report.error(f"#{job.index}: {type(e).__name__}: {e}")
                progress[0] += 1

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    report.completed = progress[0]


# -- memory -------------------------------------------------------------------------------------


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            out.append(child)
            todo.append(child)
    return out


def _app_processes(root: int) -> dict[str, list[int]]:
    """The app's Ray processes by role, from their process titles (`ray::...`)."""
    roles = {
        f"ServeReplica:{APP_NAME}:Ingress": "ingress",
        f"ServeReplica:{APP_NAME}:EngineDeployment": "engine_replica",
        "SchedulerActor": "scheduler",
        "WorkerActor": "worker",
        "ProxyActor": "http_proxy",
    }
    out: dict[str, list[int]] = defaultdict(list)
    for pid in _descendants(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        for key, role in roles.items():
            if title.startswith(f"ray::{key}"):
                out[role].append(pid)
    return out


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples the app's processes' RSS every `period_s`, tagged with the requests done."""

    def __init__(self, processes: dict[str, list[int]], progress: list[int], period_s: float):
        self.processes = processes
        self.progress = progress
        self.period_s = period_s
        self.samples: list[tuple[int, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            row = {}
            for role, pids in self.processes.items():
                sizes = [s for p in pids if (s := _rss_mb(p)) is not None]
                if sizes:
                    row[role] = sum(sizes)
            self.samples.append((self.progress[0], row))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def quarters(self, total: int) -> tuple[dict[str, float], dict[str, float]]:
        def mean(rows: list[dict[str, float]]) -> dict[str, float]:
            keys = {k for r in rows for k in r}
            return {k: round(sum(r[k] for r in rows if k in r) / len(rows), 1) for k in keys}

        first = [row for done, row in self.samples if done < total / 4]
        last = [row for done, row in self.samples if done >= 3 * total / 4]
        return (mean(first) if first else {}), (mean(last) if last else {})


# -- the server and its engine ------------------------------------------------------------------


def _metrics(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kvray:num_requests") or s.name == "kvray:kv_cache_usage_perc"
    }


def _settle(base_url: str, idle_usage: float, report: SoakReport, timeout_s: float) -> None:
    """Wait for the gauges to come back to idle; record where they end."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(base_url)
        report.running = m.get("kvray:num_requests_running")
        report.waiting = m.get("kvray:num_requests_waiting")
        report.final_kv_usage = m.get("kvray:kv_cache_usage_perc")
        idle = report.running == 0 and report.waiting == 0
        if idle and report.final_kv_usage is not None and report.final_kv_usage <= idle_usage:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)


def _check_engine(num_pages: int, report: SoakReport) -> None:
    import ray

    from kvray.deploy.app import is_app_scheduler

    names = [a for a in ray.util.list_named_actors(True) if is_app_scheduler(a["name"], APP_NAME)]
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    try:
        ray.get(actor.check_integrity.remote())
        report.integrity_ok = True
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report.integrity_ok = False
        report.error(f"check_integrity: {e}")
    ray.get(actor.flush_cache.remote())
    usage = ray.get(actor.stats.remote())["kv_cache_usage"]
    report.pages_leaked = round(usage * num_pages)
    if not ray.get(actor.is_idle_and_empty.remote()):
        report.error("the engine is not idle and empty after the soak")


def run(cfg: SoakConfig, num_pages: int, model: str | None) -> SoakReport:
    import ray
    from ray import serve

    from kvray.cluster.spec import resolve_model_path
    from kvray.deploy.app import start_app
    from kvray.deploy.settings import ServeConfig

    model_path = resolve_model_path(model, progress=True)
    settings = ServeConfig(
        model=str(model_path), num_pages=num_pages, served_model_name="soak", app_name=APP_NAME
    ).resolved()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, configure_logging=False)
    try:
        start_app(settings, "127.0.0.1", port)
        report = SoakReport()
        report.idle_kv_usage = _metrics(base_url)["kvray:kv_cache_usage_perc"]
        progress = [0]
        start = time.monotonic()
        with RssSampler(_app_processes(os.getpid()), progress, 0.5) as sampler:
            asyncio.run(drive(base_url, cfg, report, progress))
        report.seconds = round(time.monotonic() - start, 1)
        _settle(base_url, report.idle_kv_usage, report, timeout_s=60)
        _check_engine(num_pages, report)
        first, last = sampler.quarters(report.requests)
        report.rss_mb_first_quarter, report.rss_mb_last_quarter = first, last
        report.rss_growth_mb = {k: round(last[k] - first[k], 1) for k in first if k in last}
        step = max(1, len(sampler.samples) // 16)
        report.rss_timeline = sampler.samples[::step]
        return report
    finally:
        serve.shutdown()
        ray.shutdown()


ROLES = ("ingress", "http_proxy", "engine_replica", "scheduler", "worker")


def failures(report: SoakReport, rss_slack_mb: float, rss_roles: tuple[str, ...]) -> list[str]:
    """What the soak must show; empty when it passed. RSS growth is judged for
    `rss_roles` and reported for every role."""
    out = []
    if report.errors:
        out.append(f"{report.errors} errors: {report.error_samples[:5]}")
    if report.running != 0 or report.waiting != 0:
        out.append(f"gauges not idle: running {report.running}, waiting {report.waiting}")
    if report.final_kv_usage is None or report.final_kv_usage > report.idle_kv_usage:
        out.append(f"KV usage {report.final_kv_usage} above idle {report.idle_kv_usage}")
    if not report.integrity_ok:
        out.append("check_integrity failed")
    if report.pages_leaked != 0:
        out.append(f"{report.pages_leaked} pages leaked")
    if not report.rss_growth_mb:
        out.append("no RSS samples in the first and last quarters")
    for role, growth in report.rss_growth_mb.items():
        if role in rss_roles and growth > rss_slack_mb:
            out.append(f"{role} RSS grew {growth} MB from the first to the last quarter")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench soak", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.2, help="fraction cut mid-request")
    ap.add_argument("--bad", type=float, default=0.05, help="fraction of malformed bodies")
    ap.add_argument("--num-pages", type=int, default=256, help="KV pool (small: forces eviction)")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[4, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--rss-slack-mb", type=float, default=32.0, help="allowed RSS growth")
    ap.add_argument(
        "--rss-roles",
        default=",".join(ROLES),
        help=f"comma-separated processes whose RSS must not grow (default: all of {ROLES})",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    cfg = SoakConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        disconnect=args.disconnect,
        bad=args.bad,
        max_tokens=tuple(args.max_tokens),
        seed=args.seed,
    )
    report = run(cfg, args.num_pages, args.model)
    roles = tuple(r for r in args.rss_roles.split(",") if r)
    unknown = set(roles) - set(ROLES)
    if unknown:
        ap.error(f"--rss-roles: unknown {sorted(unknown)}; choose from {ROLES}")
    verdict = failures(report, args.rss_slack_mb, roles)
    out = {**asdict(report), "config": asdict(cfg), "failures": verdict}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if out["failures"]:
        print("soak FAILED:\n  " + "\n  ".join(out["failures"]), file=sys.stderr)
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    main()
