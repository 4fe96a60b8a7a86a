"""CPU time each Ray process of a running `kvray serve` spends per streamed chunk, under N
concurrent streams: where the serving path's cost goes at load.

    kvray serve --port 8000 &
    python scripts/serve_cpu_per_token.py --url http://127.0.0.1:8000/v1 --concurrency 8

Sends one warm-up request, then N streamed completions at once (random token-id prompts,
greedy, EOS ignored), and prints the chunks per second and, for every Ray process on this
machine (`ps`: workers, scheduler, ingress, proxy...), its user + system CPU time over the
run divided by the chunks streamed. A chunk is one token, except where the detokenizer
holds back half a UTF-8 character. Linux only (/proc); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import time

import httpx


def ray_processes() -> dict[int, str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True)
    procs = {}
    for line in out.stdout.splitlines()[1:]:
        pid, args = line.strip().split(" ", 1)
        if args.startswith("ray::"):
            procs[int(pid)] = args.split()[0]
    return procs


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, prompt_len: int, output_len: int
) -> int:
    body = {
        "model": model,
        "prompt": [random.randrange(100, 40000) for _ in range(prompt_len)],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            chunks += line.startswith("data:") and "[DONE]" not in line
    return chunks


async def run(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        model = (await client.get(f"{args.url}/models")).json()["data"][0]["id"]
        await stream_one(client, args.url, model, args.prompt_len, args.output_len)
        procs = ray_processes()
        before = {pid: cpu_seconds(pid) for pid in procs}
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(
                stream_one(client, args.url, model, args.prompt_len, args.output_len)
                for _ in range(args.concurrency)
            )
        )
        elapsed = time.perf_counter() - start
    chunks = sum(counts)
    rate = chunks / elapsed
    print(f"{args.concurrency} streams: {chunks} chunks in {elapsed:.1f} s = {rate:.1f}/s")
    rows = sorted(((cpu_seconds(p) - before[p]) * 1e3 / chunks, name) for p, name in procs.items())
    for ms, name in reversed(rows):
        if ms >= 0.05:
            print(f"  {ms:6.2f} ms CPU per chunk  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
