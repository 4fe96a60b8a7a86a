"""The offline API's inputs as vLLM users write them: SamplingParams refuses wrong types by
field; prompts as text, token ids (numpy's too) or vLLM prompt dicts; max_tokens None runs
to the end of the context; logprobs come with their alternatives; a shut-down LLM refuses
work; and `kvray generate` reports bad settings in one line, before loading a model."""

from __future__ import annotations

import numpy as np
import pytest
from engine_checks import TINY_PROMPTS

from kvray import LLM, SamplingParams
from kvray.deploy.cli import main


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"logprobs": True}, "logprobs must be an integer"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"stop": [1, 2]}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids must be an integer"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"n": 0}, "n must be >= 1"),
    ],
)
def test_sampling_params_refuse_wrong_types(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_integers_and_no_max_tokens() -> None:
    sp = SamplingParams(max_tokens=np.int64(5), seed=np.int32(3), stop_token_ids=np.array([1, 2]))
    assert (sp.max_tokens, sp.seed, sp.stop_token_ids) == (5, 3, (1, 2))
    assert type(sp.max_tokens) is int and SamplingParams(max_tokens=None).max_tokens is None


def test_prompt_forms_logprobs_and_shutdown(tiny) -> None:
    path, refs = tiny["llama"]
    ids, ref = TINY_PROMPTS[0], refs[0]
    greedy = SamplingParams(temperature=0, max_tokens=len(ref))
    with LLM(path, dtype="float32", progress=False) as llm:
        forms = [ids, np.array(ids), {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]]
        for prompt in forms:
            (out,) = llm.generate(prompt, greedy)
            assert out.token_ids == ref, prompt
        text = "xqz"  # (ids within the tiny vocabulary)
        (by_text,) = llm.generate({"prompt": text}, greedy)
        assert by_text.token_ids == llm.generate(text, greedy)[0].token_ids
        assert by_text.prompt_token_ids == llm.encode(text)
        # read as vLLM's RequestOutput: one choice, the prompt's text kept
        assert by_text.prompt == text and by_text.finished
        (choice,) = by_text.outputs
        assert (choice.index, choice.text, choice.token_ids) == (0, by_text.text, by_text.token_ids)
        assert choice.cumulative_logprob is None and out.prompt is None
        with pytest.raises(ValueError, match="exactly one of 'prompt'"):
            llm.generate({"text": "hi"}, greedy)
        with pytest.raises(TypeError, match="item 1 is 2.5"):
            llm.generate([[1, 2.5]], greedy)

        (out,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, logprobs=3))
        assert len(out.logprobs) == len(out.top_logprobs) == 4
        assert out.cumulative_logprob == pytest.approx(sum(out.logprobs))
        for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            assert top[tok] == lp and len(top) == 3 and lp == max(top.values())  # greedy

        # No max_tokens: up to the end of the context.
        (out,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
        assert len(ids) + len(out.token_ids) == llm.spec.max_seq_len
        assert out.finish_reason == "length"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(ids, greedy)


def test_vllm_spellings_of_engine_args_params_and_chat(tiny) -> None:
    """What a vLLM script writes runs as it means: vLLM's engine-argument names, None for
    "no stops" and "no top_k", n choices (a seeded one's choice i as its own request with
    seed + i) and use_tqdm (chat's spellings: tests/test_engine.py)."""
    path, refs = tiny["llama"]
    ids = TINY_PROMPTS[0]
    with pytest.warns(UserWarning, match="trust_remote_code changes nothing"):
        llm = LLM(
            path,
            dtype="float",
            tensor_parallel_size=1,
            max_model_len=96,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            block_size=8,
            enable_prefix_caching=False,
            trust_remote_code=True,
            progress=False,
        )
    with llm:
        c = llm.config
        assert (c.dtype, c.tp_size, c.max_seq_len, c.max_running_reqs) == ("float32", 1, 96, 8)
        assert (c.max_prefill_tokens, c.page_size, c.cache_policy) == (64, 8, "naive")
        none = SamplingParams(
            temperature=0, max_tokens=5, stop=None, stop_token_ids=None, top_k=None
        )
        assert (none.stop, none.stop_token_ids, none.top_k) == ((), (), -1)
        (out,) = llm.generate(ids, none, use_tqdm=False)
        assert out.token_ids == refs[0][:5]

        seeded = SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=3, ignore_eos=True)
        (three,) = llm.generate(ids, seeded)
        assert [o.index for o in three.outputs] == [0, 1, 2] and three.outputs[0] is three
        for i, choice in enumerate(three.outputs):
            (alone,) = llm.generate(
                ids, SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i, ignore_eos=True)
            )
            assert choice.token_ids == alone.token_ids, i
        assert len({tuple(o.token_ids) for o in three.outputs}) > 1
        # with a list of params, each prompt its own n
        a, b = llm.generate([ids, ids], [SamplingParams(max_tokens=2, n=2), none])
        assert len(a.outputs) == 2 and b.outputs == [b] and b.token_ids == refs[0][:5]

        # max_tokens None: min_tokens must fit in what is left of the context
        from kvray.core import RequestRejected

        with pytest.raises(RequestRejected, match="min_tokens is 200") as e:
            llm.generate(ids, SamplingParams(max_tokens=None, min_tokens=200))
        assert e.value.param == "min_tokens"
    with pytest.raises(ValueError, match="tensor_parallel_size and tp_size name one setting"):
        LLM(path, tensor_parallel_size=1, tp_size=1, progress=False)


def test_default_params_are_the_checkpoints_own(tiny, tmp_path) -> None:
    """As vLLM's: generation_config.json's sampling settings are the defaults of a call
    that gives no params (a value SamplingParams would refuse is not a default); params
    given are used as they are."""
    import json
    import shutil

    path = shutil.copytree(tiny["llama"][0], tmp_path / "ckpt")
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7, repetition_penalty=-1)
    (path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(path, dtype="float32", progress=False) as llm:
        want = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
        assert llm.get_default_sampling_params() == want
        assert llm.get_tokenizer() is llm.tokenizer is not None
        (out,) = llm.generate(TINY_PROMPTS[0])
        assert len(out.token_ids) == 7
        (out,) = llm.generate(TINY_PROMPTS[0], SamplingParams(max_tokens=3))
        assert len(out.token_ids) == 3
    # A default max_new_tokens longer than the room a prompt leaves is cut to that room
    # (the caller asked for no budget); a budget the caller gives is still checked.
    from kvray.core import RequestRejected

    gen.update(max_new_tokens=1000, eos_token_id=None)  # (no EOS: it runs to its budget)
    (path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(path, dtype="float32", max_seq_len=64, progress=False) as llm:
        prompt = list(range(10, 60))
        (out,) = llm.generate(prompt)
        assert len(out.token_ids) == 64 - len(prompt) and out.finish_reason == "length"
        with pytest.raises(RequestRejected, match="max_tokens is 1000"):
            llm.generate(prompt, llm.get_default_sampling_params())


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-tokens", "0"], "error: max_tokens must be >= 1"),
        (["--temperature", "nan"], "error: temperature must be a finite number"),
        (["--model", "/nonexistent/checkpoint"], "is not a Hugging Face checkpoint directory"),
        (["--page-size", "0"], "error: page_size: Input should be greater than 0"),
    ],
)
def test_generate_reports_bad_settings_in_one_line(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_enable_prefix_caching_none_is_vllms_default_not_off() -> None:
    """vLLM's LLM(enable_prefix_caching=None) means "not given"; True / False pick the
    cache policy; a contradiction is an error."""
    from kvray.cluster.llm import _engine_args

    assert _engine_args({"enable_prefix_caching": None}) == {}
    assert _engine_args({"enable_prefix_caching": True}) == {"cache_policy": "radix"}
    assert _engine_args({"enable_prefix_caching": False}) == {"cache_policy": "naive"}
    with pytest.raises(ValueError, match="contradicts"):
        _engine_args({"enable_prefix_caching": False, "cache_policy": "radix"})
