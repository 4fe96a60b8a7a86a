"""`kvray bench prefix` and `kvray bench serve` run end to end at tiny sizes.

prefix: a tiny random Llama (float32, one torch thread), 2 groups x 3 requests; the radix
cache must compute fewer prefill tokens than the naive one, exactly the workload's floor.

serve: the client against an in-process stub of the OpenAI SSE completions endpoint (the
client logic is what is tested; a real kvray Serve app is covered by tests/test_serve.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# -- prefix ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvray.bench.dispatch import write_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return path


def test_prefix_bench_runs(tiny_model, tmp_path, capsys) -> None:
    import torch

    from kvray.bench.prefix import main

    threads = torch.get_num_threads()
    out = tmp_path / "prefix.json"
    report = main(
        [
            "--model", str(tiny_model), "--dtype", "float32", "--threads", "1",
            "--groups", "2", "--per-group", "3", "--prefix-len", "64", "--suffix-len", "8",
            "--output-len", "4", "--no-progress", "--json", str(out),
        ]
    )  # fmt: skip
    assert torch.get_num_threads() == threads  # --threads applies to the benchmark only
    assert report["machine"]["torch_threads"] == 1
    text = capsys.readouterr().out
    assert "theoretical floor of the prefill ratio" in text and "radix/naive" in text
    saved = json.loads(out.read_text())
    s = saved["summary"]
    assert s == report["summary"]
    for key in (
        "radix_prefill_tokens",
        "naive_prefill_tokens",
        "radix_ttft_p50_s",
        "naive_ttft_p50_s",
        "radix_ttft_p99_s",
        "naive_ttft_p99_s",
        "radix_output_tok_s",
        "naive_output_tok_s",
        "prefill_ratio_radix_over_naive",
        "ttft_p50_ratio_naive_over_radix",
        "prefill_ratio_floor",
    ):
        assert key in s, key
    assert s["radix_prefill_tokens"] < s["naive_prefill_tokens"]
    # naive computes every prompt token; radix each group's prefix once plus every suffix
    # (the prefix is page aligned and every request of a group waits for its first one).
    assert s["naive_prefill_tokens"] == 6 * (64 + 8)
    assert s["radix_prefill_tokens"] == 2 * 64 + 6 * 8
    assert s["prefill_ratio_floor"] == pytest.approx((2 * 64 + 6 * 8) / (6 * 72))
    assert s["prefill_ratio_radix_over_naive"] == pytest.approx(s["prefill_ratio_floor"])
    for policy in ("radix", "naive"):
        r = saved["results"][policy]
        assert r["num_requests"] == 6 and r["output_tokens"] == 6 * 4
        assert len(r["ttft_s"]) == 6 and all(t > 0 for t in r["ttft_s"])
        assert s[f"{policy}_ttft_p50_s"] <= s[f"{policy}_ttft_p99_s"]
        assert s[f"{policy}_output_tok_s"] > 0
    assert sum(saved["results"]["radix"]["cached_tokens"]) == 4 * 64
    assert sum(saved["results"]["naive"]["cached_tokens"]) == 0
    assert out.with_suffix(".png").is_file()


def test_prefix_workload() -> None:
    from kvray.bench.prefix import Workload

    w = Workload(groups=2, per_group=3, prefix_len=32, suffix_len=4, output_len=2, seed=1)
    prompts = w.prompts(49152)
    assert len(prompts) == 6 and all(len(p) == 36 for p in prompts)
    assert all(100 <= t < 49152 - 100 for p in prompts for t in p)
    assert prompts[0][:32] == prompts[2][:32] != prompts[1][:32]  # groups interleaved
    assert len({tuple(p[32:]) for p in prompts}) == 6
    assert w.prompts(49152) == prompts  # seeded


# -- serve ----------------------------------------------------------------------------------

STUB_MODEL = "stub-model"
API_KEY = "sk-test"


def _stub_app(received: list[dict]):
    """/v1/models and a streaming /v1/completions: one SSE chunk per token, except that
    every third chunk carries two tokens (as a real server's detokenizer may merge them),
    then the usage chunk and [DONE]."""
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {API_KEY}"

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return {"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        received.append(body)
        n = body["max_tokens"]

        async def events():
            await asyncio.sleep(0.01)  # "prefill"
            sent = 0
            k = 0
            while sent < n:
                take = 2 if k % 3 == 2 and sent + 2 <= n else 1
                sent += take
                k += 1
                chunk = {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": STUB_MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "text": "ab"[:take],
                            "logprobs": None,
                            "finish_reason": "length" if sent == n else None,
                        }
                    ],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.002)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def stub_server():
    import uvicorn

    received: list[dict] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_stub_app(received), log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1", received
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_serve_bench_runs(stub_server, tmp_path, capsys) -> None:
    from kvray.bench.serve import PERCENTILES, main

    url, received = stub_server
    out = tmp_path / "serve.json"
    report = main(
        [
            "--url", url, "--rate", "inf", "50", "--num-requests", "4", "--api-key", API_KEY,
            "--input-len", "8", "16", "--output-len", "4", "9", "--no-progress",
            "--json", str(out),
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert "TTFT p50" in text and STUB_MODEL in text
    saved = json.loads(out.read_text())
    assert saved["summary"] == report["summary"]
    assert list(saved["summary"]) == ["inf", "50"]
    for s in saved["summary"].values():
        assert s["completed"] == 4 and s["failures"] == 0 and s["errors"] == {}
        for name in ("ttft", "itl", "tpot", "e2e"):
            values = [s[f"{name}_p{q}_s"] for q in PERCENTILES]
            assert all(v is not None and v > 0 for v in values), (name, values)
            assert values == sorted(values), (name, values)
        assert s["ttft_p50_s"] < s["e2e_p50_s"]
        assert s["request_throughput"] > 0 and s["output_token_throughput"] > 0
    assert out.with_suffix(".png").is_file()

    # The requests: the same seeded prompts at each rate, as the server's API expects them.
    assert len(received) == 8
    for body in received:
        assert body["model"] == STUB_MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert 8 <= len(body["prompt"]) <= 16 and 4 <= body["max_tokens"] <= 9
        assert all(isinstance(t, int) and 100 <= t < 10000 for t in body["prompt"])
    # Each rate sends its own prompts: a later rate finds none of them in the prefix cache.
    first = {tuple(b["prompt"]) for b in received[:4]}
    assert len(first) == 4 and first.isdisjoint(tuple(b["prompt"]) for b in received[4:])
    # Output tokens come from the usage chunk, not from counting chunks (some carry two).
    for r in saved["requests"]["inf"]:
        assert r["ok"] and r["output_tokens"] == r["max_tokens"]
        assert r["chunks"] < r["output_tokens"] or r["output_tokens"] < 3
        assert len(r["itl_s"]) == r["chunks"] - 1


def test_serve_bench_counts_failures(stub_server, tmp_path) -> None:
    """A wrong API key: every request fails with the server's message, none hangs."""
    from kvray.bench.serve import main

    url, received = stub_server
    report = main(
        [
            "--url", url, "--rate", "inf", "--num-requests", "3", "--model", STUB_MODEL,
            "--api-key", "wrong", "--input-len", "4", "4", "--output-len", "2", "2",
            "--no-progress",
        ]
    )  # fmt: skip
    s = report["summary"]["inf"]
    assert s["completed"] == 0 and s["failures"] == 3
    assert s["errors"] == {"HTTP 401: bad key": 3}
    assert s["ttft_p50_s"] is None and s["output_token_throughput"] == 0
    assert received == []


def test_poisson_arrivals() -> None:
    from kvray.bench.serve import arrival_offsets

    assert arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    t = arrival_offsets(2000, 10.0, 0)
    assert t[0] == 0.0 and t == sorted(t)
    assert t == arrival_offsets(2000, 10.0, 0)  # seeded
    assert 2000 / t[-1] == pytest.approx(10.0, rel=0.1)


def test_serve_bench_unreachable(capsys) -> None:
    """No server at the URL: a one-line error and exit status 1, not a traceback."""
    from kvray.bench.serve import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(SystemExit) as exc:
        main(["--url", f"http://127.0.0.1:{port}/v1", "--num-requests", "1", "--no-progress"])
    assert exc.value.code == 1
    assert "cannot reach" in capsys.readouterr().err
