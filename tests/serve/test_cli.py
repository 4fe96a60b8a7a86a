"""`kvray serve` from the shell: a subprocess with its own Ray instance serves the embedded
model behind an API key, answers the README's request, and shuts down cleanly on SIGINT."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-kvray-test"
README_REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 32,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def session_processes(sid: int) -> list[str]:
    """Command lines of the live processes in session `sid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # session id; skip zombies
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                out.append(cmd.decode(errors="replace").strip())
        except (OSError, IndexError, ValueError):
            continue
    return out


@pytest.mark.timeout(400)
def test_cli_serve_smoke(tmp_path: Path) -> None:
    from kvray.models.embedded import ensure_embedded_model

    ensure_embedded_model(progress=False)  # converted once, outside the timed start
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvray.deploy.cli",
            "serve",
            "--num-pages",
            "512",
            "--port",
            str(port),
            "--api-key",
            KEY,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C and cleanup reach all of it
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def stderr_tail() -> str:
        log.flush()
        return (tmp_path / "stderr.log").read_text()[-4000:]

    try:
        # 1. It prints the "serving" line once the app is up.
        deadline = time.monotonic() + 180
        serving = None
        while serving is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no 'serving' line within 180 s\n{stderr_tail()}"
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"exited with {proc.wait()} before serving\n{stderr_tail()}"
            if "serving" in line:
                serving = line
        assert f"http://127.0.0.1:{port}/v1" in serving, serving
        assert MODEL in serving, serving

        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=base, timeout=120) as http:
            # 2. /health is open; /v1/* needs the key.
            assert http.get("/health").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = http.post("/v1/chat/completions", json=README_REQUEST, headers=headers)
                assert r.status_code == 401, (headers, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["message"]
            r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = http.get("/v1/models", headers=auth)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
            # 3. The README's request answers "Paris".
            r = http.post("/v1/chat/completions", json=README_REQUEST, headers=auth)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]["content"]
            assert "Paris" in answer, answer
            # /metrics is outside /v1 and stays open too
            assert http.get("/metrics").status_code == 200

        # 4. Ctrl-C (SIGINT to its process group): exits 0 within 30 s, stops listening,
        # and leaves none of the Ray processes it started behind.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGINT\n{stderr_tail()}")
        assert rc == 0, f"exit code {rc}\n{stderr_tail()}"
        assert not port_open(port)
        deadline = time.monotonic() + 15
        while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes left behind after exit: {left}"
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        log.close()
