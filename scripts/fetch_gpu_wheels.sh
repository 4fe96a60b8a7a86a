#!/usr/bin/env bash
# Download, into .whl/, the wheels that the lent GPU machine lacks (Python 3.12, x86-64,
# no package index there), for scripts/gpu_check.sh to install. Run it here, then name
# `.whl` in the device run's `carry`. The versions are those of this checkout's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# What kvray imports that the GPU image does not have (its package list: the device
# tool's KINDS.md): pydantic and what pydantic needs beyond typing-extensions.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection)
pins=()
for p in "${PACKAGES[@]}"; do
  pins+=("$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")")
done
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls -l .whl
