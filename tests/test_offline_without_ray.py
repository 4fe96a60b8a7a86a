"""Offline use needs no Ray: `kvray generate --device ...` and `LLM(device=...)` at TP 1 run
in one process where `import ray` fails (a GPU machine may not have Ray at all)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    class NoRay:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError("Ray is not installed here")
            return None

    sys.meta_path.insert(0, NoRay())
    from kvray.deploy.cli import main

    rc = main(sys.argv[1:])
    from kvray import LLM, SamplingParams

    llm = LLM(sys.argv[3], device="cpu", dtype="float32", progress=False)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out.token_ids) == 3 and llm.engine.worker.device.type == "cpu"
    assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules), "ray imported"
    print("rc", rc, "tokens", out.token_ids)
    """
)


def test_generate_and_llm_without_ray(tiny) -> None:
    path, _ = tiny["llama"]
    args = ["generate", "--model", path, "--device", "cpu", "--dtype", "float32"]
    args += ["--prompt", "xqz", "--max-tokens", "4", "--raw"]  # ids below the tiny vocabulary
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rc 0 tokens" in proc.stdout
    text = proc.stdout.split("rc 0")[0].strip()
    assert text, "kvray generate printed no text"
