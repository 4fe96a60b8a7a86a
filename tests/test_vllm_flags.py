"""A `vllm serve` / `vllm.LLM` user's spellings read as kvray's settings: the flags parse
into the same ServeConfig as kvray's own, a contradiction is refused, and the flags that
change nothing here are accepted with a note saying why."""

from __future__ import annotations

import pytest

from kvray.config import EngineConfig
from kvray.deploy.cli import parse_args
from kvray.deploy.flags import model_from_flags
from kvray.deploy.settings import ServeConfig


def serve_config(*argv: str) -> ServeConfig:
    config: ServeConfig = model_from_flags(ServeConfig, parse_args(["serve", *argv]))
    return config


def test_a_vllm_serve_command_line_means_the_same_settings() -> None:
    vllm = serve_config(
        "/models/llama",
        "--tensor-parallel-size", "2",
        "--max-model-len", "4096",
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "1024",
        "--block-size", "32",
        "--dtype", "half",
        "--no-enable-prefix-caching",
        "--served-model-name", "llama",
    )  # fmt: skip
    ours = serve_config(
        "--model", "/models/llama",
        "--tp-size", "2",
        "--max-seq-len", "4096",
        "--max-running-reqs", "64",
        "--max-prefill-tokens", "1024",
        "--page-size", "32",
        "--dtype", "float16",
        "--cache-policy", "naive",
        "--served-model-name", "llama",
    )  # fmt: skip
    assert vllm == ours
    assert (
        serve_config("-tp", "2", "--dtype", "float").model_dump()
        == ServeConfig(tp_size=2, dtype="float32").model_dump()
    )
    assert serve_config("--enable-prefix-caching").cache_policy == "radix"


def test_vllm_dtype_names_in_a_config_and_offline() -> None:
    assert EngineConfig(dtype="half").dtype == "float16"
    assert ServeConfig(dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["/a", "--model", "/b"], "the model is given twice"),
        (["--no-enable-prefix-caching", "--cache-policy", "radix"], "contradicts --cache-policy"),
        (["--dtype", "double"], "invalid choice: 'double'"),
    ],
)
def test_contradictions_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve", *argv])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_flags_that_change_nothing_are_accepted_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--trust-remote-code",
        "--gpu-memory-utilization", "0.9",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    ]  # fmt: skip
    assert serve_config(*argv) == serve_config()
    err = capsys.readouterr().err
    for flag in [a for a in argv if a.startswith("--")]:
        assert f"note: {flag} is ignored" in err, flag
    capsys.readouterr()
    serve_config("--max-num-seqs", "8")
    assert "note" not in capsys.readouterr().err
