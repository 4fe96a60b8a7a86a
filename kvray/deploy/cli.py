"""The `kvray` command line: `kvray generate`, `kvray bench ...`."""

from __future__ import annotations

import argparse
import sys

from kvray.attention import backend_names
from kvray.kvcache import PREFIX_CACHES


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache", default="radix", choices=PREFIX_CACHES.names())
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=backend_names())
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: CUDA when there is a GPU)",
    )


def _generate(args: argparse.Namespace) -> int:
    from kvray import LLM, SamplingParams
    from kvray.core import RequestRejected

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        page_size=args.page_size,
        cache=args.cache,
        num_pages=args.num_pages,
        attention_backend=args.attention_backend,
        device=args.device,
    )
    sp = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    try:
        if getattr(llm.tokenizer, "chat_template", None) and not args.raw:
            out = llm.chat([{"role": "user", "content": args.prompt}], sp)[0]
        else:
            out = llm.generate([args.prompt], sp)[0]
    except RequestRejected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    import ray
    from ray import serve

    from kvray.cluster.spec import resolve_model_path
    from kvray.config import EngineConfig
    from kvray.deploy.app import ServeSettings, drain, live_placement_groups, start_app

    # Resolve (and, for the embedded model, convert) once, here, with progress shown.
    model_path = resolve_model_path(args.model, progress=True)
    if args.served_model_name:
        model_name = args.served_model_name
    elif args.model is None:
        from kvray.models.embedded import EMBEDDED_MODEL_NAME

        model_name = EMBEDDED_MODEL_NAME
    else:
        model_name = model_path.name
    config = EngineConfig(
        model=str(model_path),
        tp_size=args.tp,
        dtype=args.dtype,
        page_size=args.page_size,
        cache_policy=args.cache,
        num_pages=args.num_pages,
        max_running_reqs=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        attention_backend=args.attention_backend,
        device=args.device,
    )
    settings = ServeSettings(
        engine=config.model_dump(),
        model_name=model_name,
        replicas=args.replicas,
        api_key=args.api_key or os.environ.get("KVRAY_API_KEY") or None,
        compiled=not args.no_compiled_graph,
        public_paths=tuple(args.public_path),
        max_tokens_default=args.max_tokens_default,
        max_tokens_cap=args.max_tokens_cap,
        special_tokens_in_messages=args.special_tokens_in_messages,
    )
    print(f"[kvray] starting Ray ({args.address or 'local'})...", file=sys.stderr, flush=True)
    ray.init(address=args.address, include_dashboard=False, configure_logging=False)
    print(
        f"[kvray] loading {model_name}: {args.replicas} engine(s) x TP {args.tp}...",
        file=sys.stderr,
        flush=True,
    )
    start_app(settings, args.host, args.port)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"[kvray] serving {model_name} at http://{host}:{args.port}/v1", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    grace = args.shutdown_grace_s
    print(f"[kvray] draining (up to {grace:g} s)...", file=sys.stderr, flush=True)
    # Every step is bounded: when the whole process group got the signal (Ctrl-C), Ray's
    # own processes may already be gone, and a call to them would wait forever.
    left: list[int] = []
    drainer = threading.Thread(
        target=lambda: left.append(drain(settings.app_name, grace)), daemon=True
    )
    drainer.start()
    drainer.join(grace + 15)
    if left and left[0]:
        print(f"[kvray] {left[0]} request(s) cut at the grace period", file=sys.stderr, flush=True)
    print("[kvray] shutting down...", file=sys.stderr, flush=True)
    closer = threading.Thread(target=serve.shutdown, daemon=True)
    closer.start()
    closer.join(30)
    try:
        pgs = live_placement_groups()
        print(f"[kvray] stopped; placement groups left: {pgs}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - the cluster is already gone
        pass
    ray.shutdown()
    return 0


_BENCHES = ("offline", "prefix", "serve", "scheduler", "dispatch", "soak")


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"kvray.bench.{args.what}")
    module.main(args.rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvray", description="LLM serving with a paged KV cache")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt offline and print the text")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_engine_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API through Ray Serve")
    _add_engine_args(s)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size per engine")
    s.add_argument("--replicas", type=int, default=1, help="data-parallel engines")
    s.add_argument("--max-running", type=int, default=256)
    s.add_argument("--max-prefill-tokens", type=int, default=2048)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this key (or set KVRAY_API_KEY)")
    s.add_argument("--address", default=None, help="Ray cluster to join (default: start one)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--no-compiled-graph", action="store_true", help="dispatch steps with plain actor calls"
    )
    s.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="tokens to generate when a request sets no limit (default: the rest of the context)",
    )
    s.add_argument(
        "--max-tokens-cap", type=int, default=None, help="refuse requests asking for more tokens"
    )
    s.add_argument(
        "--special-tokens-in-messages",
        action="store_true",
        help="let special-token text typed in chat messages become special tokens (as vLLM)",
    )
    s.add_argument(
        "--public-path",
        action="append",
        default=[],
        choices=["/metrics", "/openapi.json"],
        help="leave this path open when --api-key is set (repeatable; /health always is)",
    )
    s.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, let running requests finish for up to this long",
    )
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="benchmarks (see `kvray bench scheduler --help`)")
    b.add_argument("what", choices=_BENCHES)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)

    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
