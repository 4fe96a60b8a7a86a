"""The `kvray` command line: `kvray generate`, `kvray bench ...`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from pydantic import ValidationError

from kvray.attention import backend_names
from kvray.config import EngineConfig
from kvray.deploy.flags import add_model_flags, model_from_flags
from kvray.deploy.settings import ServeConfig
from kvray.deploy.vllm_flags import add_vllm_flags, read_vllm_flags
from kvray.kvcache import PREFIX_CACHES

API_KEY_ENV = "KVRAY_API_KEY"  # read when neither --api-key nor --api-key-env is given


def _registry_choices() -> dict[str, list[str]]:
    """Allowed values of the settings whose choices are registries (mini-sglang style)."""
    return {"attention_backend": backend_names(), "cache_policy": PREFIX_CACHES.names()}


def _generate(args: argparse.Namespace) -> int:
    from kvray import LLM, SamplingParams
    from kvray.core import RequestRejected

    # The request's settings first: a bad one is an error before a model loads.
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    config = model_from_flags(EngineConfig, args)
    llm = LLM(**config.model_dump())
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
    direct = args.address is None if args.direct_ingress is None else args.direct_ingress
    if direct and args.address is not None:
        print("error: --direct-ingress needs a cluster this command starts", file=sys.stderr)
        return 2

    # A signal before the app serves stops the start-up where it is (Ray's processes are
    # shut down, not orphaned); after, it starts the drain below.
    stop, serving = threading.Event(), threading.Event()

    def on_signal(signum: int, _: object) -> None:
        stop.set()
        if not serving.is_set():
            raise _StoppedStarting(signal.Signals(signum).name)

    def arm() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    arm()
    try:
        return _start_and_serve(args, direct, arm, stop, serving)
    except _StoppedStarting as e:
        print(f"[kvray] {e} before serving: stopping", file=sys.stderr, flush=True)
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        _stop_ray()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _build_kernels() -> None:
    """Compile, before the workers start, the CPU kernels torch's cache lacks (a fresh
    machine, a new kvray or torch): a worker compiles each one alone as it first loads it,
    about 100 s for all of them on 2 cores; here they build side by side, one per core.
    The workers of a cluster this command starts run on this machine's CPU, the one
    `-march=native` compiles for."""
    from kvray import cpu_ext

    pending = cpu_ext.pending_builds()
    if not pending:
        return
    print(
        f"[kvray] compiling {len(pending)} CPU kernel(s) for this CPU (once per machine)...",
        file=sys.stderr,
        flush=True,
    )
    cpu_ext.build_all(jobs=min(len(pending), os.cpu_count() or 1), modules=pending)


class _StoppedStarting(BaseException):
    """SIGINT or SIGTERM while `kvray serve` was starting. (Not an Exception: a signal
    handler raises it wherever start-up is, and a broad `except Exception` there, in
    kvray's code or Ray's, must not swallow it, as KeyboardInterrupt is not swallowed.)"""


def _stop_ray(report_placement_groups: bool = False) -> None:
    """Serve's app and then this process's Ray, each step bounded (when the whole process
    group got the signal, Ray's own processes may already be gone)."""
    import ray

    if not ray.is_initialized():
        return
    from ray import serve

    from kvray.deploy.app import live_placement_groups

    closer = threading.Thread(target=serve.shutdown, daemon=True)
    closer.start()
    closer.join(30)
    if report_placement_groups:
        try:
            pgs = live_placement_groups()
            print(f"[kvray] stopped; placement groups left: {pgs}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - the cluster is already gone
            pass
    ray.shutdown()


def _start_and_serve(
    args: argparse.Namespace,
    direct: bool,
    arm: Callable[[], None],
    stop: threading.Event,
    serving: threading.Event,
) -> int:
    from kvray.cluster.spec import (
        check_max_seq_len,
        check_tp_split,
        is_hub_id,
        resolve_device,
        resolve_model_path,
    )
    from kvray.deploy.app import direct_ingress_env, own_cluster_env
    from kvray.models import ModelConfig
    from kvray.net import wait_for_port

    config = model_from_flags(ServeConfig, args)
    # Resolve (and, for the embedded model, convert) once, here, with progress shown. A
    # checkpoint kvray cannot run, or cannot split over --tp-size, is an error now, not in
    # the engine replicas' logs once Ray and Serve are up.
    path = resolve_model_path(config.model, progress=True)
    model_config = ModelConfig.from_pretrained(path)
    check_tp_split(model_config, config.tp_size)
    check_max_seq_len(model_config, config.max_seq_len)

    # Serve's HTTP server binds without SO_REUSEADDR, so a restart within a minute of the
    # last server's connections would fail (and its direct ingress would then give up on
    # the port for good): wait for the port here, or say why it cannot be had.
    if args.address is None and (err := wait_for_port(args.host, args.port)) is not None:
        print(f"error: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 2
    if args.address is None and resolve_device(config.device) == "cpu":
        _build_kernels()
    if args.address is None:  # before Ray starts: its processes inherit them
        for key, value in own_cluster_env().items():
            os.environ.setdefault(key, value)
    if direct:
        os.environ.update(direct_ingress_env(args.port))

    import ray

    from kvray.deploy.app import drain, start_app

    if config.api_key is None and config.api_key_env is None and os.environ.get(API_KEY_ENV):
        config = config.model_copy(update={"api_key_env": API_KEY_ENV})
    # On a cluster already running (--address) replicas may be on other nodes, where this
    # node's Hub cache path means nothing: they get the Hub id and resolve it themselves.
    remote_hub = args.address is not None and config.model is not None and is_hub_id(config.model)
    settings = config.resolved(None if remote_hub else str(path))
    model_name = settings.served_model_name
    print(f"[kvray] starting Ray ({args.address or 'local'})...", file=sys.stderr, flush=True)
    ray.init(address=args.address, include_dashboard=False, configure_logging=False)
    # Ray's core worker installs its own SIGTERM handler (it exits at once, status 15) while
    # ray.init runs: a signal in those seconds ends the process that way, and Ray's own
    # processes go with it; from here on, ours stops the start-up or drains.
    arm()
    print(
        f"[kvray] loading {model_name}: {settings.replicas} engine(s) x TP {settings.tp_size}...",
        file=sys.stderr,
        flush=True,
    )
    start_app(settings, args.host, args.port, direct_ingress=direct)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"[kvray] serving {model_name} at http://{host}:{args.port}/v1", flush=True)
    serving.set()
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
    _stop_ray(report_placement_groups=True)
    return 0


_BENCHES = (
    "offline",
    "prefix",
    "serve",
    "overhead",
    "scheduler",
    "dispatch",
    "soak",
    "structured",
)


# Benches that run an engine in this process (beside whatever servers they start).
_IN_PROCESS = ("offline", "overhead")


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"kvray.bench.{args.what}")
    module.main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvray", description="LLM serving with a paged KV cache")
    sub = ap.add_subparsers(dest="command", required=True)

    choices = _registry_choices()
    g = sub.add_parser("generate", help="complete one prompt offline and print the text")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_model_flags(g, EngineConfig, choices=choices)
    add_vllm_flags(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API through Ray Serve")
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the checkpoint, as in `vllm serve MODEL` (the same as --model)",
    )
    add_model_flags(s, ServeConfig, choices=choices)
    add_vllm_flags(s)
    # The serving process's own settings (not the app's: a serve config has its own).
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--address", default=None, help="Ray cluster to join (default: start one)")
    s.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the API replica answers HTTP itself, without Ray Serve's proxy in between "
        "(default: on when this command starts the Ray cluster; needs that)",
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
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line read, vLLM's spellings folded into kvray's settings."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command in ("serve", "generate"):
        try:
            read_vllm_flags(args)
        except ValueError as e:
            ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if argv is None and (args.command == "generate" or getattr(args, "what", "") in _IN_PROCESS):
        # The engine runs in this process: start it again with tcmalloc (host_memory).
        from kvray.workers.host_memory import reexec_with_tcmalloc

        reexec_with_tcmalloc()
    try:
        return int(args.func(args))
    except ValidationError as e:  # a setting out of range: the fields and what is wrong
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"error: {where}: {err['msg']}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # a bad model path, checkpoint or setting
        print(f"error: {e}", file=sys.stderr)
        return 2


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


if __name__ == "__main__":
    raise SystemExit(main())
