"""`kvray bench overhead`: what the serving path adds to one request's TTFT and ITL.

    kvray bench overhead [--requests 12] [--prompt-len 32] [--output-len 64]
                         [--dtype bfloat16] [--url URL] [--json PATH]

The same short requests (random token-id prompts, greedy, EOS ignored), one at a time,
through two paths:

- in process: the engine core with its worker in this process (`LocalEngine`, what
  `kvray.LLM` runs), stepped directly; TTFT = `add_request` to the first token event,
  ITL = the gaps between token events;
- served: streamed completions over HTTP from `kvray serve` (Ray Serve proxy, ingress,
  engine deployment, scheduler actor, worker actor), started here on a free port with the
  same model and dtype (or the server at `--url`); TTFT = request sent to the first chunk
  with text, ITL = the gaps between such chunks (the bench checks each carries one token).

The paths take turns, request by request (each prompt in process, then served), so that a
slow spell of a noisy machine falls on both. It prints each path's p50 / p99 and the
difference of the p50s: the overhead of the serving path. One request at a time, so the
figures are latency, not throughput. Run it on a quiet machine: on two cores, any other
busy process shows up in both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvray.bench import servers
from kvray.bench.report import DTYPE_HELP, default_dtype, machine_info, print_table, write_json


def _workload(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, prompt_len).tolist() for _ in range(n)]


@dataclass(frozen=True)
class Samples:
    """Each path's samples, in seconds (`ttft_s`, `itl_s`), and how many streams had their
    ITLs left out on both paths (two tokens in one chunk)."""

    local: dict[str, list[float]]
    served: dict[str, list[float]]
    merged_streams: int


class InProcess:
    """The in-process path: the engine core with its worker in this process (what
    `kvray.LLM` runs), stepped directly."""

    def __init__(self, model: str | None, dtype: str, output_len: int) -> None:
        from kvray import LLM, SamplingParams

        self.llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True)
        self.sampling = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        self.output_len = output_len

    def run(self, prompt: list[int]) -> tuple[float, list[float]]:
        """(TTFT, ITLs) of `prompt` run alone, in seconds."""
        engine = self.llm.engine
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, self.sampling)
        times: list[float] = []
        while engine.has_work:
            for ev in engine.step():
                if ev.rid == rid and ev.token_id is not None:
                    times.append(time.perf_counter())
        if len(times) != self.output_len:
            raise RuntimeError(f"in-process run produced {len(times)} of {self.output_len} tokens")
        return times[0] - t0, np.diff(times).tolist()


async def _interleaved(
    local: InProcess, url: str, prompts: list[list[int]], output_len: int, api_key: str | None
) -> Samples:
    """Each prompt through both paths, one after the other (the first warms both up), so
    that both see the same spells of a noisy machine."""
    import httpx

    from kvray.bench.serve import _fetch_model, send_one

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, dict[str, list[float]]] = {
        path: {"ttft_s": [], "itl_s": []} for path in ("local", "served")
    }
    merged = 0
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        model = await _fetch_model(client, url, headers)
        for i, prompt in enumerate([prompts[0], *prompts]):
            ttft, itl = local.run(prompt)
            await asyncio.sleep(0.05)  # the in-process OpenMP team stops spinning
            res = await send_one(client, url, headers, model, i, prompt, output_len, 300.0)
            if not res.ok or res.ttft_s is None:
                raise RuntimeError(f"served request failed: {res.error}")
            await asyncio.sleep(0.05)
            if i == 0:
                continue
            out["local"]["ttft_s"].append(ttft)
            out["served"]["ttft_s"].append(res.ttft_s)
            # A token that ends mid-character (a byte of a multi-byte one) is sent with the
            # next: that stream's chunk gaps are not all inter-token latencies, so neither
            # path's gaps of this prompt count.
            if res.chunks == res.output_tokens:
                out["local"]["itl_s"].extend(itl)
                out["served"]["itl_s"].extend(res.itl_s)
            else:
                merged += 1
    if merged == len(prompts):
        raise RuntimeError("every stream sent some tokens together: no inter-token latency")
    local.llm.engine.check_integrity()
    return Samples(out["local"], out["served"], merged)


def measure(args: argparse.Namespace, prompts: list[list[int]], output_len: int) -> Samples:
    """Both paths' samples: the server at `args.url`, or one started here."""
    from kvray.net import free_port

    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        print(f"starting kvray serve on port {port} ...", flush=True)
        proc = servers.launch_kvray(args.model, args.dtype, port)
    try:
        servers.wait_ready(url, proc, args.start_timeout)
        local = InProcess(args.model, args.dtype, output_len)
        return asyncio.run(_interleaved(local, url, prompts, output_len, args.api_key))
    finally:
        if proc is not None:
            servers.stop(proc)


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench overhead",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument(
        "--dtype",
        default=default_dtype(),
        choices=["bfloat16", "float16", "float32"],
        help=DTYPE_HELP,
    )
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--url", default=None, help="a running kvray serve (default: start one)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (ITL needs two tokens)")

    from kvray.cluster.spec import EngineSpec
    from kvray.config import EngineConfig

    vocab = EngineSpec.resolve(EngineConfig(model=args.model)).vocab_size
    prompts = _workload(args.requests, args.prompt_len, vocab, args.seed)
    samples = measure(args, prompts, args.output_len)
    local, remote = samples.local, samples.served

    rows = []
    for name, r in (("in process", local), ("served (HTTP)", remote)):
        rows.append(
            [name, _p(r["ttft_s"], 50), _p(r["ttft_s"], 99), _p(r["itl_s"], 50), _p(r["itl_s"], 99)]
        )
    added = [a - b for a, b in zip(rows[1][1:], rows[0][1:], strict=True)]
    rows.append(["added by serving", *added])
    if samples.merged_streams:
        print(
            f"({samples.merged_streams} of {args.requests} streams sent two tokens in one "
            "chunk (a character split across tokens): their ITLs are left out on both paths)"
        )
    print_table(
        f"one request at a time, the paths taking turns: {args.prompt_len}-token prompt, "
        f"{args.output_len} tokens, {args.requests} requests",
        ["path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
        rows,
    )
    summary = {
        "inprocess_ttft_p50_ms": rows[0][1],
        "inprocess_itl_p50_ms": rows[0][3],
        "served_ttft_p50_ms": rows[1][1],
        "served_itl_p50_ms": rows[1][3],
        "added_ttft_p50_ms": added[0],
        "added_itl_p50_ms": added[2],
    }
    write_json(args.json, summary, config=vars(args), machine=machine_info())
    return {"summary": summary}


if __name__ == "__main__":
    main()
