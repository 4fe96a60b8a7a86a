"""`kvray bench structured`: what grammar-constrained rows add to a decode step.

    kvray bench structured [--rows 64] [--prompt-len 64] [--steps 24] [--rounds 5]
                           [--dtype bfloat16] [--model PATH] [--json PATH]

One in-process engine (`LocalEngine`, the embedded model unless `--model`) runs two
batches of `--rows` requests with the same random-token prompts, taking turns, `--rounds`
times (A, B, A, B, ...; a first A/B pair warms up and is not counted):

- A, free: every row unconstrained;
- B, constrained: every row under one JSON Schema (an array of at least 50 objects, so no
  row's grammar can end inside the measured steps): a bitmask filled and applied per row,
  and each matcher advanced on its token.

Each round times the engine's decode-only steps (plan, forward, mask, sample, matcher
advance, result), and compares the two medians; the figure is the median of the rounds'
ratios B / A. Interleaving keeps a noisy machine from favouring either side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from kvray.bench.report import DTYPE_HELP, default_dtype, machine_info, print_table, write_json

SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "qty": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["new", "used", "spare"]}},
        },
        "required": ["name", "qty", "tags"],
    },
    "minItems": 50,
}


def decode_step_times(engine: Any, prompts: list[list[int]], sampling: Any) -> list[float]:
    """Seconds of each step in which every row decodes (prefill steps left out)."""
    for p in prompts:
        engine.add_request(p, sampling)
    times: list[float] = []
    while engine.has_work:
        decoding = all(not r.prefilling for r in engine.scheduler.running) and not (
            engine.scheduler.waiting
        )
        full = len(engine.scheduler.running) == len(prompts)
        t0 = time.perf_counter()
        engine.step()
        if decoding and full:
            times.append(time.perf_counter() - t0)
    return times


def run(
    model: str | None, dtype: str, rows: int, prompt_len: int, steps: int, rounds: int
) -> dict[str, Any]:
    from kvray import LLM, SamplingParams
    from kvray.core import StructuredOutputsParams

    llm = LLM(model=model, dtype=dtype, max_running_reqs=max(rows, 1), progress=False)
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.spec.vocab_size
    prompts = [rng.integers(100, vocab - 100, prompt_len).tolist() for _ in range(rows)]
    free = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=steps + 1,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    free_ms: list[float] = []
    constrained_ms: list[float] = []
    ratios: list[float] = []
    for r in range(rounds + 1):
        a = statistics.median(decode_step_times(engine, prompts, free))
        b = statistics.median(decode_step_times(engine, prompts, constrained))
        if r == 0:
            continue  # warm-up: first-use allocations, the grammar's compilation
        free_ms.append(a * 1e3)
        constrained_ms.append(b * 1e3)
        ratios.append(b / a)
    return {
        "free_ms": free_ms,
        "constrained_ms": constrained_ms,
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="kvray bench structured",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--dtype", default=default_dtype(), help=DTYPE_HELP)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    out = run(args.model, args.dtype, args.rows, args.prompt_len, args.steps, args.rounds)
    rows = [
        [i + 1, f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}"]
        for i, (a, b) in enumerate(zip(out["free_ms"], out["constrained_ms"], strict=True))
    ]
    print_table(
        f"decode step, {args.rows} rows: free vs JSON-Schema constrained (interleaved)",
        ["round", "free ms (p50)", "constrained ms (p50)", "ratio"],
        rows,
    )
    print(
        f"constrained / free decode step: {out['ratio']:.3f}x "
        f"(+{(out['ratio'] - 1) * 100:.1f}%, median of {len(out['ratios'])} rounds)"
    )
    write_json(args.json, {"constrained_over_free": out["ratio"]}, machine=machine_info(), **out)
    return out


if __name__ == "__main__":
    main()
