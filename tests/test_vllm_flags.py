"""A `vllm serve` / `vllm.LLM` user's spellings read as kvray's settings: the flags parse
into the same ServeConfig as kvray's own, a contradiction is refused, and the flags that
change nothing here are accepted with a note saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_checks import TINY_PROMPTS

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
        "--generation-config", "vllm",
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
        "--generation-config", "none",
        "--served-model-name", "llama",
    )  # fmt: skip
    assert vllm == ours
    assert (
        serve_config("-tp", "2", "--dtype", "float").model_dump()
        == ServeConfig(tp_size=2, dtype="float32").model_dump()
    )
    assert serve_config("--enable-prefix-caching").cache_policy == "radix"


def test_token_counts_read_as_vllm_reads_them() -> None:
    """--max-model-len and --max-num-batched-tokens take vLLM's suffixes: k, m decimal,
    K, M binary; anything else is refused by the flag, naming it."""
    config = serve_config("--max-model-len", "32k", "--max-num-batched-tokens", "2K")
    assert (config.max_seq_len, config.max_prefill_tokens) == (32000, 2048)
    assert serve_config("--max-seq-len", "1.5k").max_seq_len == 1500
    assert serve_config("--max-seq-len", "1.001k").max_seq_len == 1001  # no float rounding
    assert serve_config("--max-seq-len", "4096").max_seq_len == 4096
    for bad in ("1.5K", "1.2345k", "12x", "k"):
        with pytest.raises(SystemExit):
            serve_config("--max-model-len", bad)


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
        "--enforce-eager",
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


@pytest.fixture
def hub_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """An offline Hugging Face cache (the Hub's own layout) in tmp_path."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def cache_model(cache, repo_id: str, checkpoint) -> None:
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo / "snapshots" / commit)


def test_a_hugging_face_model_id_runs_from_the_hub_cache(tiny, hub_cache) -> None:
    """`LLM("org/name")` / `kvray serve org/name` as in vLLM: the cached snapshot runs, and
    the server's model name is the id; an id that is neither cached nor downloadable (here:
    offline) is one clear error."""
    from kvray import LLM, SamplingParams
    from kvray.cluster.spec import resolve_model_path

    path, refs = tiny["llama"]
    cache_model(hub_cache, "tiny-org/tiny-llama", path)
    with LLM("tiny-org/tiny-llama", dtype="float32", progress=False) as llm:
        assert llm.spec.model_path.is_relative_to(hub_cache)
        (out,) = llm.generate(TINY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
        assert out.token_ids == refs[0][:4]
    config = serve_config("tiny-org/tiny-llama")
    resolved = config.resolved(str(resolve_model_path(config.model)))
    assert resolved.served_model_name == "tiny-org/tiny-llama"
    assert resolved.model is not None and resolved.model.startswith(str(hub_cache))
    assert serve_config(str(path)).resolved().served_model_name == Path(path).name
    with pytest.raises(FileNotFoundError, match="'no-org/missing' is not a local checkpoint"):
        resolve_model_path("no-org/missing")
    with pytest.raises(FileNotFoundError, match="nor a Hugging Face model id"):
        resolve_model_path("/no/such/dir")


def test_a_partly_cached_hub_model_is_not_taken_for_a_checkpoint(tiny, hub_cache) -> None:
    """What AutoConfig / AutoTokenizer leave in the cache (config and tokenizer, no
    weights; or an index whose shards are not all there) is no checkpoint: offline it is
    one clear error naming what is missing, while a process that only tokenizes
    (weights=False) takes it."""
    import json
    import shutil

    from kvray.cluster.spec import resolve_model_path

    path, _ = tiny["llama"]
    partial = hub_cache / "partial"
    shutil.copytree(path, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    cache_model(hub_cache, "tiny-org/no-weights", partial)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        resolve_model_path("tiny-org/no-weights")
    assert (resolve_model_path("tiny-org/no-weights", weights=False) / "config.json").is_file()

    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    cache_model(hub_cache, "tiny-org/sharded", partial)
    with pytest.raises(FileNotFoundError, match="no model-00001-of-00002.safetensors"):
        resolve_model_path("tiny-org/sharded")


def test_chat_template_and_allowed_origins_as_vllm_takes_them(tmp_path) -> None:
    """--chat-template is a file or the Jinja text (a file is read where the app starts:
    replicas get its text); --allowed-origins repeats, or takes vLLM's JSON list."""
    jinja = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(jinja)
    assert serve_config("--chat-template", str(path)).resolved().chat_template == jinja
    assert serve_config("--chat-template", jinja).resolved().chat_template == jinja
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        serve_config("--chat-template", str(tmp_path / "missing.jinja")).resolved()
    origins = ("https://a.example", "https://b.example")
    assert serve_config("--allowed-origins", json.dumps(list(origins))).allowed_origins == origins
    repeated = serve_config("--allowed-origins", origins[0], "--allowed-origins", origins[1])
    assert repeated.allowed_origins == origins and serve_config().allowed_origins == ()
    # a serve config's value: the JSON list as one string, a list, or one origin
    as_json = ServeConfig(allowed_origins=json.dumps(list(origins)))
    assert as_json.allowed_origins == ServeConfig(allowed_origins=list(origins)).allowed_origins
    assert as_json.allowed_origins == origins
    assert ServeConfig(allowed_origins=origins[0]).allowed_origins == origins[:1]
    # several after one flag, or comma-separated, with the model before or after them
    assert serve_config("/m", "--allowed-origins", *origins).allowed_origins == origins
    listed = serve_config("--allowed-origins", ",".join(origins), "--model", "/m")
    assert listed.allowed_origins == origins and listed.model == "/m"


def test_several_served_model_names() -> None:
    """vLLM's --served-model-name takes several names: the first names responses, every one
    is a request's `model` (kvray keeps the others as served_model_aliases). Before, argparse
    took the second name for the positional MODEL."""
    both = serve_config("/m", "--served-model-name", "llama-3", "llama")
    assert both.model == "/m"
    assert (both.served_model_name, both.served_model_aliases) == ("llama-3", ("llama",))
    one = serve_config("--served-model-name", "llama-3")
    assert (one.model, one.served_model_name, one.served_model_aliases) == (None, "llama-3", ())
    assert serve_config("--served-model-name", "").served_model_name is None  # blank: unset
    more = serve_config("--served-model-name", "a", "b", "--served-model-aliases", "c", "b", "a")
    assert (more.served_model_name, more.served_model_aliases) == ("a", ("b", "c"))
    # unnamed, the model is served under its directory's name, and an alias equal to that
    # name is dropped when the name is resolved
    aliased = serve_config("/m/llama", "--served-model-aliases", "llama", "l").resolved()
    assert (aliased.served_model_name, aliased.served_model_aliases) == ("llama", ("l",))
    assert ServeConfig(served_model_name=["a", "b"]).served_model_aliases == ("b",)
