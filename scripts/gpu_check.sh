#!/usr/bin/env bash
# The CUDA path in one call: on a lent GPU machine, from the repo root,
#
#     scripts/fetch_gpu_wheels.sh          # here, once: wheels the GPU image lacks -> .whl/
#     device run: scripts/gpu_check.sh     # there, with carry [".whl"]
#
# 1. installs what is missing there from the carried wheels (.whl/),
# 2. runs the GPU-marked tests (token parity with Hugging Face on tiny random Llama, Qwen2
#    and Qwen3 checkpoints, float32 and bfloat16, page sizes 1 and 16, both cache
#    policies, chunked prefill),
# 3. runs `kvray bench offline` on random weights of Qwen3-0.6B's shape with mini-sglang's
#    offline workload (256 requests, input and output lengths uniform in 100..1024, EOS
#    ignored) against Hugging Face `generate` on the same GPU,
#
# writing gpu_check.log, gpu_tests.xml and bench_offline.{json,png} to $OUT (default
# ./.gpu_check_out). About 8 minutes on one H200.
#
#     scripts/gpu_check.sh --dry-run       # the same steps on this CPU, tiny model, ~1 min
#
# The dry run (in `make test`) keeps the script from rotting: the tests run on CPUs with
# the Triton kernels on the interpreter, the bench on a tiny random model.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
OUT="${OUT:-$PWD/.gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "== kvray gpu_check ($([ $dry_run = 1 ] && echo dry run || echo GPU)), $(date -u +%FT%TZ)"
# 1. What is missing, from carried wheels (installed beside, never over, the image's own).
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "pydantic is missing and no wheels were carried: run scripts/fetch_gpu_wheels.sh" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/kvray-site .whl/*.whl
  export PYTHONPATH="/tmp/kvray-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
"$PY" - <<'PYEOF'
import torch, transformers
print(f"python ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")
PYEOF

if [ $dry_run = 1 ]; then
  export KVRAY_TEST_DEVICE=cpu TRITON_INTERPRET=1
  # One float32 and one bfloat16 case (page sizes 1 and 16).
  tests=(-k "float32_greedy and llama-1-radix or bfloat16_greedy and qwen3-16")
  bench=(--device cpu --random-model tiny-llama --dtype float32 --num-requests 8
         --input-len 8 32 --output-len 4 16 --decode-running 8 --decode-prompt-len 16
         --decode-steps 4 --hf-batch 4)
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device here (use --dry-run on a CPU)" >&2; exit 2; }
  tests=()
  bench=(--device cuda --random-model qwen3-0.6b --dtype bfloat16 --num-requests 256
         --input-len 100 1024 --output-len 100 1024 --hf-batch 64 --kv-cache-memory-gb 40
         --max-prefill-tokens 8192)
fi

# 2. Parity tests. A failure is reported, and the bench still runs.
echo "== pytest -m gpu"
tests_rc=0
"$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
  ${tests[@]+"${tests[@]}"} || tests_rc=$?

# 3. Throughput against Hugging Face on the same device.
echo "== kvray bench offline ${bench[*]}"
bench_rc=0
"$PY" -m kvray.deploy.cli bench offline "${bench[@]}" --json "$OUT/bench_offline.json" \
  || bench_rc=$?

echo "== summary"
"$PY" - "$OUT/bench_offline.json" <<'PYEOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"]
except (OSError, KeyError, ValueError) as e:
    sys.exit(f"no bench summary: {e}")
print(f"kvray {s['kvray_output_tok_s']:.1f} output tok/s, HF {s['baseline_output_tok_s']:.1f}, "
      f"ratio {s['output_speedup']:.2f}x; decode {s['decode_tok_s']:.1f} tok/s, "
      f"decode_mfu {s['decode_mfu']:.3f} of {s['matmul_peak_tflops']:.1f} TFLOP/s "
      f"({s['device']}, {s['attention_backend']})")
PYEOF
echo "tests exit ${tests_rc}, bench exit ${bench_rc}"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ]
