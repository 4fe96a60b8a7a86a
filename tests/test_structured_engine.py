"""Grammar-constrained decoding in the engine, on a tiny random checkpoint (float32):

- constrained greedy output equals an oracle: Hugging Face's logits, restricted at each
  step to the tokens the grammar allows, argmax (lowest id on ties);
- a property test: random schemas x random batch mixes (constrained and free rows, greedy
  and seeded) on a pool small enough to force retraction, with overlapped steps and worker
  replays at random points: every finished constrained output is valid, and after every
  step each running constrained row's matcher has taken exactly the tokens its request
  holds (plus the ones still in flight);
- a grammar compiles once per spec, however many requests use it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from engine_checks import TINY_VOCAB, new_llm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.cluster.engine_core import MAX_REPLAYS, EngineCore
from kvray.cluster.executor import LocalExecutor, WorkerFailure
from kvray.cluster.spec import EngineSpec
from kvray.config import EngineConfig
from kvray.core import FinishReason, SamplingParams, StructuredOutputsParams, TokenEvent
from kvray.grammar import GrammarCompiler, GrammarError

pytestmark = pytest.mark.usefixtures("engine_invariants")

STOP = 2  # <|im_end|> in the SmolLM2 tokenizer the tiny checkpoints carry
PROMPT = [17, 40, 99, 120, 33, 250, 7, 64, 180]


def _json_spec(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


ORACLE_SPECS = [
    _json_spec(
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"enum": ["x", "yz"]},
                "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            },
            "required": ["a", "b", "c"],
        }
    ),
    StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=("alpha", "beta", "gamma")),
]


def _allowed(matcher: Any, vocab: int) -> torch.Tensor:
    """The grammar's allowed tokens as a bool [vocab] (bits unpacked here, not by kvray)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


def masked_hf_greedy(
    hf: Any, grammar: Any, prompt: list[int], max_tokens: int, min_tokens: int = 0
) -> list[int]:
    """The oracle: HF's next-token logits, grammar-disallowed tokens removed, argmax; the
    stop token held back while fewer than `min_tokens` are out, unless the grammar allows
    nothing else."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=[STOP])
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        allowed = _allowed(matcher, TINY_VOCAB)
        if len(out) < min_tokens and allowed.sum() > allowed[STOP]:
            allowed[STOP] = False
        logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(torch.argmax(logits))  # the first maximum: ties to the lowest id
        assert matcher.accept_token(token)
        out.append(token)
        ids.append(token)
        if token == STOP:
            break
    return out


def test_constrained_greedy_equals_masked_hf_oracle(tiny_checkpoints: dict) -> None:
    path, hf = tiny_checkpoints["llama"]
    llm = new_llm(path, page_size=4, num_pages=64)
    compiler = llm.grammar_compiler()
    max_tokens = 40
    constrained = [
        SamplingParams(
            temperature=0.0, max_tokens=max_tokens, stop_token_ids=(STOP,), structured_outputs=s
        )
        for s in ORACLE_SPECS
    ]
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # One batch: the constrained rows and a free one beside them.
    outs = llm.generate([PROMPT] * 4, [*constrained, free])
    for spec, out in zip(ORACLE_SPECS, outs, strict=False):
        want = masked_hf_greedy(hf, compiler.compile(spec), PROMPT, max_tokens)
        assert out.token_ids == want, spec.key
        assert out.finish_reason == "stop"
    text = [o.text for o in outs]
    jsonschema.validate(json.loads(text[0]), json.loads(ORACLE_SPECS[0].key[1]))
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{1,3}", text[1]) and text[2] in ("alpha", "beta", "gamma")
    # The free row is untouched by its constrained batch mates.
    assert outs[3].token_ids == llm.generate([PROMPT], free)[0].token_ids


def test_min_tokens_gives_way_only_to_a_complete_grammar(tiny_checkpoints: dict) -> None:
    """min_tokens holds back the stop token while the grammar allows anything else; once
    the grammar is complete (only the stop token is left) the request ends there, valid,
    however few tokens are out."""
    path, hf = tiny_checkpoints["llama"]
    llm = new_llm(path, page_size=4, num_pages=64)
    compiler = llm.grammar_compiler()
    specs = [StructuredOutputsParams(regex=r"[a-f]{1,9}"), ORACLE_SPECS[2]]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            min_tokens=12,
            stop_token_ids=(STOP,),
            structured_outputs=spec,
        )
        for spec in specs
    ]
    outs = llm.generate([PROMPT] * 2, params)
    for spec, out in zip(specs, outs, strict=True):
        want = masked_hf_greedy(hf, compiler.compile(spec), PROMPT, 30, min_tokens=12)
        assert out.token_ids == want, spec.key
        assert out.finish_reason == "stop" and len(out.token_ids) < 12
    assert re.fullmatch(r"[a-f]{1,9}", outs[0].text) and outs[1].text in ("alpha", "beta", "gamma")


def test_a_grammar_compiles_once_and_refusals_name_no_engine(tiny_checkpoints: dict) -> None:
    path, _ = tiny_checkpoints["llama"]
    compiler = GrammarCompiler(_tokenizer(path), TINY_VOCAB)
    compiled: list[float] = []
    compiler.on_compile = compiled.append
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}}
    for i in range(1000):  # the same schema, written with different spacing
        text = json.dumps(schema, indent=i % 3)
        compiler.compile(StructuredOutputsParams(json=text))
    assert len(compiled) == 1
    with pytest.raises(GrammarError):
        compiler.compile(StructuredOutputsParams(regex="(unclosed"))


def _tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# -- the property test ---------------------------------------------------------------------------

_leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-5, 5),
        st.integers(0, 20),
    ),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["a", "bc", "d e", "f"]), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"enum": xs}
    ),
    st.integers(1, 3).map(lambda n: {"type": "string", "pattern": f"^[a-c]{{1,{n}}}$"}),
)


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(["p", "q", "r"]), values, min_size=1, max_size=2).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)}
    )


SCHEMAS = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        _object(inner),
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 2}),
    ),
    max_leaves=3,
)
SPECS = st.one_of(
    SCHEMAS.map(_json_spec),
    st.sampled_from([r"[0-9]{1,4}", r"(ab|cd)+e?", r"x[yz]{0,3}"]).map(
        lambda r: StructuredOutputsParams(regex=r)
    ),
    st.lists(st.sampled_from(["on", "off", "auto"]), min_size=1, max_size=3, unique=True).map(
        lambda c: StructuredOutputsParams(choice=tuple(c))
    ),
)
ROWS = st.lists(
    st.tuples(
        st.one_of(st.none(), SPECS),  # None: a free row
        st.sampled_from([0.0, 1.0]),
        st.integers(0, 2**16),
        st.integers(1, 12),  # prompt length
    ),
    min_size=2,
    max_size=6,
)


@pytest.fixture(scope="module")
def small_engine(tiny_checkpoints: dict) -> EngineCore:
    """Overlapped steps (plan N+1 before result N) on a 12-page pool of 4 tokens: a few
    requests of up to 12 + 32 tokens cannot all fit, so some are retracted."""
    path, _ = tiny_checkpoints["llama"]
    config = EngineConfig(
        model=str(path), dtype="float32", page_size=4, num_pages=12, max_running_reqs=8
    )
    spec = EngineSpec.resolve(config, progress=False)
    return EngineCore(spec, LocalExecutor(spec.worker_spec("cpu")), max_inflight=2)


def _check_matchers(engine: EngineCore) -> None:
    """Each running constrained row's matcher has taken the tokens its request holds, then
    at most the ones still in flight."""
    assert isinstance(engine.executor, LocalExecutor)
    rows = engine.executor.worker.grammar
    for req in engine.scheduler.running:
        if req.sampling.structured_outputs is None or req.table_idx not in rows:
            continue
        took, held = rows.accepted(req.table_idx), req.output_ids
        assert took[: len(held)] == held, (took, held)
        assert len(took) - len(held) <= req.pending


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(rows=ROWS, replay_at=st.one_of(st.none(), st.integers(1, 30)))
def test_random_schemas_batches_retraction_and_replay(
    small_engine: EngineCore, rows: list, replay_at: int | None
) -> None:
    engine = small_engine
    rids: dict[int, tuple[StructuredOutputsParams | None, list[int]]] = {}
    finish: dict[int, FinishReason] = {}
    for i, (spec, temperature, seed, prompt_len) in enumerate(rows):
        sp = SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=32,
            stop_token_ids=(STOP,),
            structured_outputs=spec,
        )
        prompt = [(17 + 31 * i + 7 * k) % 280 + 17 for k in range(prompt_len)]
        rids[engine.add_request(prompt, sp)] = (spec, [])
    steps = 0
    while engine.has_work:
        for ev in engine.step():
            if ev.token_id is not None:
                rids[ev.rid][1].append(ev.token_id)
            if ev.finish_reason is not None:
                finish[ev.rid] = ev.finish_reason
        engine.check_integrity()
        _check_matchers(engine)
        steps += 1
        if steps == replay_at:
            engine._recover()  # a fresh worker: matchers re-advance from the tokens held
    assert set(finish) == set(rids)
    tokenizer = _tokenizer(engine.spec.model_path)
    for rid, (spec, tokens) in rids.items():
        if spec is None or finish[rid] is not FinishReason.STOP:
            continue
        assert tokens[-1] == STOP
        text = tokenizer.decode(tokens[:-1])
        kind, body = spec.key
        if kind == "json":
            jsonschema.validate(json.loads(text), json.loads(body))
        elif kind == "regex":
            assert re.fullmatch(body, text), (body, text)
        else:
            assert text in json.loads(body)
    engine.flush_cache()
    assert engine.is_idle_and_empty()


def test_an_unchecked_spec_that_does_not_compile_ends_its_request(
    small_engine: EngineCore,
) -> None:
    """The front ends refuse it first; an engine-level caller's request just stops."""
    bad = SamplingParams(
        max_tokens=8, stop_token_ids=(STOP,), structured_outputs=StructuredOutputsParams(regex="(")
    )
    rid = small_engine.add_request(PROMPT, bad)
    events = []
    while small_engine.has_work:
        events += [ev for ev in small_engine.step() if ev.rid == rid]
    assert [(ev.token_id, ev.finish_reason) for ev in events] == [(STOP, FinishReason.STOP)]


def test_the_property_test_retracted_and_replayed(small_engine: EngineCore) -> None:
    """(Runs after it, on the same engine.) The pool was small enough to force retraction."""
    assert small_engine.scheduler.stats.num_preemptions > 0
    assert small_engine.recoveries > 0


class _PoisonedExecutor(LocalExecutor):
    """A worker that fails every step that samples for request `poisoned` (a deterministic
    fault: a replay fails the same way)."""

    poisoned: int | None = None

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.rid_of: dict[int, int] = {}  # row -> request, from the plans' admissions

    def submit(self, plan: Any) -> Any:
        self.rid_of.update({adm.row: adm.rid for adm in plan.admitted})
        if any(self.rid_of.get(int(r)) == self.poisoned for r in plan.rows[plan.sample]):
            raise WorkerFailure("poisoned request")
        return super().submit(plan)


def test_a_request_that_fails_its_worker_every_time_ends_with_an_error(
    tiny_checkpoints: dict,
) -> None:
    """The engine rebuilds and replays MAX_REPLAYS times, then ends the request with an
    error instead of rebuilding forever (a request batched with it and stalled as long
    shares its fate); then it serves the next request, and the pages balance."""
    path, _ = tiny_checkpoints["llama"]
    config = EngineConfig(model=str(path), dtype="float32", page_size=4, num_pages=64)
    spec = EngineSpec.resolve(config, progress=False)
    executor = _PoisonedExecutor(spec.worker_spec("cpu"))
    engine = EngineCore(spec, executor, max_inflight=2)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    bad = engine.add_request(PROMPT[:5], sp)
    executor.poisoned = bad
    events: list[TokenEvent] = []
    for _ in range(200):
        if not engine.has_work:
            break
        events += engine.step()
    assert not engine.has_work
    (end,) = [ev for ev in events if ev.rid == bad]
    assert end.finish_reason is FinishReason.ABORT and f"{MAX_REPLAYS} times" in (end.error or "")
    assert engine.recoveries == MAX_REPLAYS
    engine.check_integrity()
    assert engine.is_idle_and_empty()
    after = engine.add_request(PROMPT, sp)
    events = []
    while engine.has_work:
        events += engine.step()
    assert [ev.finish_reason for ev in events if ev.rid == after and ev.finished] == [
        FinishReason.LENGTH
    ]
    engine.check_integrity()


def test_a_token_the_matcher_refuses_ends_the_row_not_the_worker(tiny_checkpoints: dict) -> None:
    """A row whose sampled token its matcher refuses (possible only when no token was
    allowed) is failed like an uncompilable one: its next mask allows only its stop ids."""
    from kvray.core import Admission
    from kvray.grammar import GrammarRows

    path, _ = tiny_checkpoints["llama"]
    compiler = GrammarCompiler(_tokenizer(path), TINY_VOCAB)
    rows = GrammarRows(lambda: compiler, max_rows=4)
    sp = SamplingParams(
        stop_token_ids=(STOP,), structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    rows.admit(Admission(row=1, rid=7, sampling=sp, seed=0, stop_ids=(STOP,)))
    mask = rows.token_bitmask([1])
    assert mask is not None
    allowed = _allowed_ids(mask.bitmask[0])
    refused = next(t for t in range(TINY_VOCAB) if t not in allowed)
    rows.advance([1], [refused])  # no exception
    after = rows.token_bitmask([1])
    assert after is not None and _allowed_ids(after.bitmask[0]) == {STOP}


def _allowed_ids(words: torch.Tensor) -> set[int]:
    return {
        32 * w + b
        for w, word in enumerate(words.tolist())
        for b in range(32)
        if (word >> b) & 1 and 32 * w + b < TINY_VOCAB
    }
