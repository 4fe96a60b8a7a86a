"""Runs one `kvray bench` workload through vLLM, inside vLLM's own virtualenv.

    python vllm_runner.py WORKLOAD.json RESULT.json

This file is executed by path with the vLLM venv's interpreter (`kvray.bench.vllm_baseline`
starts it), never imported by kvray: it uses only the standard library and vLLM, since
that venv has no kvray (vLLM pins its own torch and transformers).

The workload JSON names the checkpoint, dtype, engine limits, the prompts as token ids and
each request's output length; the workload is run once untimed at a small size (vLLM
compiles its graphs then), then timed whole. Greedy, EOS ignored, nothing detokenized, as
kvray runs it. The result JSON has the elapsed seconds, the tokens produced and vLLM's
version and settings.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    engine_args: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec["dtype"],
        "skip_tokenizer_init": True,
        "seed": spec["seed"],
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "disable_log_stats": True,
        "enforce_eager": bool(spec.get("enforce_eager", False)),
    }
    if spec.get("speculative_config"):
        engine_args["speculative_config"] = spec["speculative_config"]
    llm = LLM(**engine_args)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    warm = [{"prompt_token_ids": p[:48]} for p in spec["prompts"][:64]]
    llm.generate(warm, [params(8) for _ in warm], use_tqdm=False)

    t = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for n in spec["output_lens"]], use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "version": vllm.__version__,
        "engine_args": {k: v for k, v in engine_args.items() if k != "model"},
    }


def main() -> None:
    workload_path, result_path = sys.argv[1], sys.argv[2]
    with open(workload_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in spawned processes: guard the entry
    main()
