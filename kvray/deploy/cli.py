"""The `kvray` command line: `kvray generate`, `kvray bench ...`."""

from __future__ import annotations

import argparse
import sys

from kvray.attention import backend_names
from kvray.kvcache import SUPPORTED_CACHE_MANAGER


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache", default="radix", choices=SUPPORTED_CACHE_MANAGER.names())
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=backend_names())


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


def _bench(args: argparse.Namespace) -> int:
    if args.what == "scheduler":
        from kvray.bench import scheduler

        scheduler.main(args.rest)
        return 0
    print(f"unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


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

    b = sub.add_parser("bench", help="benchmarks (see `kvray bench scheduler --help`)")
    b.add_argument("what", choices=["scheduler"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)

    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
