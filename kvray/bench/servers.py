"""Servers a benchmark starts for itself: `kvray serve` (and, through `vllm_baseline`,
`vllm serve`) as child processes in sessions of their own, waited for until they list
their models, and stopped with their whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from kvray.workers import host_memory


def launch_kvray(
    model: str | None, dtype: str, port: int, extra: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """`kvray serve` on 127.0.0.1:port in a new session (a fresh local Ray cluster), with
    `extra` flags."""
    cmd = [sys.executable, "-m", "kvray.deploy.cli", "serve", "--port", str(port)]
    cmd += ["--dtype", dtype] + (["--model", model] if model else []) + list(extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Its Ray cluster's own processes keep the system allocator; its CPU workers get
    # tcmalloc from the engine (host_memory).
    env = host_memory.env_without_added_preload(env)
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Wait until `{url}/models` answers 200 (`url` ends in /v1); fails early if `proc`
    exits."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/models", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no server at {url} within {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
