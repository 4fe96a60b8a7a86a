"""vLLM's command-line spellings that have no field of their own here, so that a
`vllm serve` command line runs as `kvray serve` with its flags unchanged.

Flags that name a kvray setting another way are that setting's aliases where it is
declared (`--tensor-parallel-size`, `--max-model-len`, `--max-num-seqs`, ...). Here are
the rest: `--enable-prefix-caching` (the prefix cache policy: radix or naive), and flags
that ask for what kvray always does or sizes another way, which are accepted with a note
saying so (an error would only make a migrating user delete them).
"""

from __future__ import annotations

import argparse
import sys

# flag -> (argparse keywords, why it changes nothing here)
_NOTED: dict[str, tuple[dict[str, object], str]] = {
    "--trust-remote-code": (
        {"action": "store_true"},
        "kvray runs no code from checkpoints (its Llama-family model is its own)",
    ),
    "--gpu-memory-utilization": (
        {"type": float, "metavar": "FRACTION"},
        "the KV pool is sized by --kv-cache-memory-gb (per rank) or --num-pages",
    ),
    "--enforce-eager": (
        {"action": "store_true"},
        "kvray always runs eagerly (no CUDA graphs or torch.compile to turn off)",
    ),
    "--enable-auto-tool-choice": (
        {"action": "store_true"},
        "tool calling is always on (tool_choice auto, required or a named function)",
    ),
    "--tool-call-parser": (
        {"type": str, "metavar": "NAME"},
        "tool calls are read in the chat template's format (Hermes' <tool_call> blocks when "
        "the template has none)",
    ),
}


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's spellings", "accepted so vLLM command lines run")
    group.add_argument(
        "--enable-prefix-caching",
        dest=_dest("--enable-prefix-caching"),
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="vLLM's switch of the prefix cache: on is --cache-policy radix (the default), "
        "off is --cache-policy naive",
    )
    for flag, (kw, why) in _NOTED.items():
        group.add_argument(
            flag, dest=_dest(flag), default=argparse.SUPPRESS, help=f"ignored: {why}", **kw
        )  # type: ignore[arg-type]


def read_vllm_flags(args: argparse.Namespace) -> None:
    """Fold vLLM's spellings into kvray's settings in `args`, in place; a note on stderr for
    each one that changes nothing. ValueError when one contradicts a kvray flag."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        given = getattr(args, "model", None)
        if given is not None and given != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {given!r}")
        args.model = tag
    prefix = getattr(args, _dest("--enable-prefix-caching"), None)
    if prefix is not None:
        policy = "radix" if prefix else "naive"
        given = getattr(args, "cache_policy", None)
        if given is not None and given != policy:
            flag = "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching"
            raise ValueError(f"{flag} contradicts --cache-policy {given}")
        args.cache_policy = policy
    for flag, (_, why) in _NOTED.items():
        if hasattr(args, _dest(flag)):
            print(f"[kvray] note: {flag} is ignored: {why}", file=sys.stderr, flush=True)
