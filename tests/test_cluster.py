"""The distributed engine on a real local Ray cluster (CPU, gloo).

- Greedy output at TP 2 and TP 4 equals the in-process TP 1 engine and Hugging Face
  `generate` on tiny random Llama checkpoints with 1, 2 and 4 KV heads (KV heads are
  replicated at TP 4 with 1 or 2 of them), and the embedded SmolLM2 at TP 3 does the same.
- Each worker actor holds a KV buffer of shape
  `(2, L, num_pages + 1, page_size, div_even(kv_heads, tp, allow_replicate=True), head_dim)`.
- A decode StepPlan's pickled size grows with the batch, never with the context.
- Killing a worker actor in the middle of 8 generations loses nothing: every request ends
  with the undisturbed greedy tokens, and the engine serves new requests afterwards
  (compiled graphs, direct step channels and plain actor calls).

After every test, each live engine's page accounting balances (`check_integrity`, and once
idle and flushed every page is free); after every shutdown, no actor and no placement group
of that engine is left in the cluster.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from hash_chain import HashChainExecutor

from kvray.bench.dispatch import write_tiny_llama
from kvray.cluster.llm import LLM
from kvray.config import SchedulerConfig
from kvray.core import SamplingParams, StructuredOutputsParams
from kvray.scheduler import Scheduler
from kvray.text import chat_ids
from kvray.workers import cpu_bind, host_memory

VOCAB = 301
MAX_NEW = 12
PAGE_SIZE = 4
NUM_PAGES = 96
PREFILL_BUDGET = 16  # every prompt but the shortest is prefilled in chunks


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(n: int, seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(lens[i % len(lens)])] for i in range(n)]


PROMPTS = _prompts(4, seed=7, lens=[5, 23, 38, 11])


def hf_greedy(hf: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy generate on one unpadded prompt, EOS ignored: the new tokens."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
        )
    new = out[0, len(ids) :].tolist()
    assert len(new) == max_new_tokens, "Hugging Face stopped early"
    return new


def assert_same(got: list[list[int]], want: list[list[int]], what: str) -> None:
    assert len(got) == len(want), what
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, f"{what}: prompts {bad} differ, e.g. #{bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


# -- the cluster, and what an engine must leave behind --------------------------------------


@pytest.fixture(scope="session")
def kvray_ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the session (8 logical CPUs, so TP 4 places on 2 cores),
    or the one some other test already started."""
    started = not ray.is_initialized()
    if started:
        # The dashboard serves the state API (ray.util.state.list_actors).
        ray.init(num_cpus=8, include_dashboard=True, configure_logging=False)
    yield
    if started:
        ray.shutdown()


def alive_actors() -> set[str]:
    try:
        from ray.util.state import list_actors

        return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)}
    except Exception:  # noqa: BLE001 - a cluster started without a dashboard
        from ray._private import state

        return set(state.actors(actor_state_name="ALIVE"))


def live_placement_groups() -> set[str]:
    return {k for k, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def cluster_snapshot() -> tuple[set[str], set[str]]:
    return alive_actors(), live_placement_groups()


_LIVE: list[LLM] = []  # engines that `engine_invariants` checks after every test


def assert_clean(llm: LLM, timeout_s: float = 10.0) -> None:
    """Page accounting balances, and once idle and flushed every page is free. With overlap
    scheduling a stale step may still be in flight right after the last request ends."""
    engine = llm.engine
    engine.check_integrity()
    deadline = time.monotonic() + timeout_s
    while True:
        engine.flush_cache()
        if engine.is_idle_and_empty():
            break
        if time.monotonic() > deadline:
            stats = engine.stats() if hasattr(engine, "stats") else {}
            raise AssertionError(f"engine not idle and empty after {timeout_s}s: {stats}")
        time.sleep(0.05)
    engine.check_integrity()


def start_engine(path: str | Path, **kw: Any) -> tuple[LLM, tuple[set[str], set[str]]]:
    """A Ray engine, and the cluster's actors and placement groups from before it."""
    before = cluster_snapshot()
    kw.setdefault("dtype", "float32")
    llm = LLM(model=str(path), use_ray=True, progress=False, **kw)
    _LIVE.append(llm)
    return llm, before


def shutdown_and_check(llm: LLM, before: tuple[set[str], set[str]]) -> None:
    """Check the engine is clean, shut it down, and wait (up to 20 s) until every actor
    and placement group it created is gone."""
    try:
        assert_clean(llm)
    finally:
        _LIVE.remove(llm)
        llm.shutdown()
    left_actors, left_pgs = wait_released(before)
    assert not left_actors and not left_pgs, (
        f"after shutdown: actors {sorted(left_actors)} still alive, "
        f"placement groups {sorted(left_pgs)} not removed"
    )


def wait_released(
    before: tuple[set[str], set[str]], timeout_s: float = 20.0
) -> tuple[set[str], set[str]]:
    """Wait until no actor or placement group created since `before` is left; returns
    what is still left when the time is up."""
    actors_before, pgs_before = before
    deadline = time.monotonic() + timeout_s
    while True:
        actors, pgs = cluster_snapshot()
        left_actors, left_pgs = actors - actors_before, pgs - pgs_before
        if (not left_actors and not left_pgs) or time.monotonic() > deadline:
            return left_actors, left_pgs
        time.sleep(0.2)


def remove_placement_groups(ids: set[str]) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id in ids:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


@pytest.fixture(autouse=True)
def engine_invariants() -> Iterator[None]:
    """After each test, every engine still alive (module-scoped ones included) is clean."""
    yield
    for llm in list(_LIVE):
        assert_clean(llm)


# -- tiny checkpoints and their references ---------------------------------------------------

# name: (num_attention_heads, num_key_value_heads)
TINY = {"kv1": (4, 1), "kv2": (8, 2), "kv4": (4, 4)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """{name: {path, hf refs, in-process TP 1 outputs}} for each TINY checkpoint."""
    out = {}
    for seed, (name, (heads, kv)) in enumerate(TINY.items()):
        path = tmp_path_factory.mktemp(f"cluster-{name}")
        hf = write_tiny_llama(
            path, seed=seed, tokenizer=True, num_attention_heads=heads, num_key_value_heads=kv
        )
        hf_refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        tp1 = LLM(
            model=str(path),
            dtype="float32",
            page_size=PAGE_SIZE,
            num_pages=NUM_PAGES,
            max_prefill_tokens=PREFILL_BUDGET,
            progress=False,
        )
        _LIVE.append(tp1)
        tp1_out = [o.token_ids for o in tp1.generate(PROMPTS, greedy(MAX_NEW))]
        assert_same(tp1_out, hf_refs, f"{name}: in-process TP 1 vs Hugging Face")
        out[name] = {"path": path, "heads": heads, "kv": kv, "hf": hf_refs, "tp1": tp1}
        out[name]["tp1_out"] = tp1_out
    yield out
    for entry in out.values():
        _LIVE.remove(entry["tp1"])


# -- 1 and 3: TP parity and the KV buffer each actor holds ----------------------------------

# Every way ranks split the KV heads: replicated on 4 and on 2 ranks each (kv1-tp4,
# kv2-tp4), one per rank (kv2-tp2), several per rank (kv4-tp2); each case is an engine
# start (about 10 s of the suite), so the other two pairings are left out.
TP_CASES = [("kv1", 4), ("kv2", 2), ("kv2", 4), ("kv4", 2)]


@pytest.fixture(scope="module", params=TP_CASES, ids=[f"{n}-tp{t}" for n, t in TP_CASES])
def tp_engine(request, kvray_ray_cluster, tiny) -> Iterator[tuple[LLM, dict[str, Any], int]]:
    """One Ray engine per (checkpoint, TP size); pytest runs every test of one before
    starting the next, so at most one of these is alive at a time. TP 4 runs as GPUs do
    by default (a compiled graph, overlap scheduling: two steps in flight), TP 2 as CPUs
    do (direct step channels, one step at a time): both paths keep parity."""
    name, tp = request.param
    entry = tiny[name]
    llm, before = start_engine(
        entry["path"],
        tp_size=tp,
        compiled=True if tp == 4 else None,
        overlap_schedule=True if tp == 4 else None,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_prefill_tokens=PREFILL_BUDGET,
    )
    yield llm, entry, tp
    shutdown_and_check(llm, before)


def _worker_actor_environs() -> list[dict[str, str]]:
    """The environment of every live worker actor process on this machine (/proc)."""
    envs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::WorkerActor"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
        except OSError:
            continue
        envs.append({k.decode(): v.decode(errors="replace") for k, v in pairs})
    return envs


def test_tp_greedy_matches_tp1_and_hf(tp_engine) -> None:
    llm, entry, tp = tp_engine
    # The engine warmed itself up before serving and kept nothing of it.
    stats = llm.engine.stats()
    assert stats["steps"] == stats["prefill_tokens"] == stats["prefix_query_tokens"] == 0
    assert stats["max_inflight_steps"] == (2 if tp == 4 else 1)
    assert stats["step_dispatch"] == ("compiled_graph" if tp == 4 else "step_channel")
    # Each rank's torch threads are pinned to cores of their own, or (none left free:
    # e.g. TP 4 on 2 cores) not at all; never two ranks on one core.
    threads = max(1, (os.cpu_count() or 1) // tp)
    pinned = stats["pinned_cpus"]
    assert len(pinned) == tp and all(len(cpus) in (0, threads) for cpus in pinned)
    flat = [c for cpus in pinned for c in cpus]
    assert len(flat) == len(set(flat)) and set(flat) <= os.sched_getaffinity(0)
    # The ranks started with the worker environment: idle OpenMP threads that sleep
    # sooner, and tcmalloc where this machine has it.
    envs = _worker_actor_environs()
    assert len(envs) >= tp
    for env in envs:
        assert env.get("GOMP_SPINCOUNT") == str(cpu_bind.WORKER_SPIN_COUNT)
        tcmalloc = host_memory.tcmalloc_path()
        assert (tcmalloc is None) or env.get("LD_PRELOAD", "").startswith(tcmalloc)
    assert llm.engine.is_idle_and_empty()
    first = [o.token_ids for o in llm.generate(PROMPTS, greedy(MAX_NEW))]
    assert_same(first, entry["hf"], f"TP {tp} vs Hugging Face")
    assert_same(first, entry["tp1_out"], f"TP {tp} vs in-process TP 1")
    # Again: now the prompts' pages come from the radix cache, on every rank.
    hits = llm.engine.stats()["prefix_hit_tokens"]
    again = [o.token_ids for o in llm.generate(PROMPTS, greedy(MAX_NEW))]
    assert_same(again, entry["hf"], f"TP {tp}, prompts cached, vs Hugging Face")
    assert llm.engine.stats()["prefix_hit_tokens"] > hits
    # One at a time (a batch of one on every rank).
    alone = [llm.generate(p, greedy(MAX_NEW))[0].token_ids for p in PROMPTS[:2]]
    assert_same(alone, entry["hf"][:2], f"TP {tp}, one at a time, vs Hugging Face")
    if (f"kv{entry['kv']}", tp) == CONSTRAINED_CASE:
        assert_constrained_matches_tp1(llm, entry, tp)


CONSTRAINED = [
    SamplingParams(
        temperature=temperature,
        seed=11,
        max_tokens=24,
        stop_token_ids=(2,),  # <|im_end|>: the tiny checkpoints have no EOS of their own
        structured_outputs=spec,
    )
    for temperature in (0.0, 1.0)
    for spec in (
        StructuredOutputsParams(
            json={"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
        ),
        StructuredOutputsParams(regex=r"[0-9]{2,6}"),
    )
]


CONSTRAINED_CASE = ("kv2", 4)  # one shape: each TP worker sets up its grammar backend


def assert_constrained_matches_tp1(llm: LLM, entry: dict[str, Any], tp: int) -> None:
    """Every rank keeps the same grammar matchers and masks: constrained output, greedy and
    seeded, is the in-process TP 1 engine's."""
    prompts = [PROMPTS[0]] * len(CONSTRAINED)
    got = [o.token_ids for o in llm.generate(prompts, CONSTRAINED)]
    want = [o.token_ids for o in entry["tp1"].generate(prompts, CONSTRAINED)]
    assert_same(got, want, f"constrained, TP {tp} vs in-process TP 1")


def expected_kv_shape(layers: int, kv: int, tp: int, head_dim: int) -> tuple[int, ...]:
    local = kv // tp if kv >= tp else 1  # replicated: one head per rank
    assert kv % tp == 0 or tp % kv == 0
    return (2, layers, NUM_PAGES + 1, PAGE_SIZE, local, head_dim)


def test_kv_buffer_shape_in_each_actor(tp_engine) -> None:
    llm, entry, tp = tp_engine
    shapes = llm.engine.kv_buffer_shapes()
    want = expected_kv_shape(2, entry["kv"], tp, 64 // entry["heads"])
    assert [tuple(s) for s in shapes] == [want] * tp


# -- 2: SmolLM2 at TP 3 -----------------------------------------------------------------------

SMOL_NEW = 16
SMOL_TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Hi"]


@pytest.fixture(scope="module")
def smol_refs() -> dict[str, Any]:
    """The embedded SmolLM2: prompt ids, Hugging Face and in-process TP 1 greedy tokens."""
    from transformers import AutoModelForCausalLM

    from kvray.models.embedded import ensure_embedded_model

    path = ensure_embedded_model(progress=False)
    tp1 = LLM(model=str(path), dtype="float32", num_pages=64, page_size=16, progress=False)
    _LIVE.append(tp1)
    tok = tp1.tokenizer
    ids = [list(tok(t)["input_ids"]) for t in SMOL_TEXTS]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids.append(chat_ids(tok, chat))
    tp1_out = [o.token_ids for o in tp1.generate(ids, greedy(SMOL_NEW))]
    _LIVE.remove(tp1)
    assert_clean(tp1)
    del tp1
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf_out = [hf_greedy(hf, p, SMOL_NEW) for p in ids]
    del hf
    assert_same(tp1_out, hf_out, "SmolLM2 in-process TP 1 vs Hugging Face")
    return {"path": path, "ids": ids, "hf": hf_out, "tp1": tp1_out}


def test_smollm2_tp3_matches_tp1_and_hf(kvray_ray_cluster, smol_refs) -> None:
    llm, before = start_engine(smol_refs["path"], tp_size=3, num_pages=64, page_size=16)
    try:
        out = llm.generate(smol_refs["ids"], greedy(SMOL_NEW))
        got = [o.token_ids for o in out]
        assert_same(got, smol_refs["hf"], "SmolLM2 TP 3 vs Hugging Face")
        assert_same(got, smol_refs["tp1"], "SmolLM2 TP 3 vs in-process TP 1")
        assert "Paris" in out[-1].text
        # 30 layers, 3 KV heads over 3 ranks: one each.
        assert [tuple(s) for s in llm.engine.kv_buffer_shapes()] == [(2, 30, 65, 16, 1, 64)] * 3
    finally:
        shutdown_and_check(llm, before)


def test_tp2_speculative_decoding_matches_hf(kvray_ray_cluster, tiny) -> None:
    """n-gram drafts checked on two ranks: HF's greedy tokens exactly. Overlap scheduling
    (drafts need every token known at planning) is refused beside them. Requests with
    penalties and a logit bias (which never draft) run beside them, and each rank
    processes their logits alike: HF's tokens with the same processing."""
    from engine_checks import hf_processed
    from transformers import AutoModelForCausalLM

    entry = tiny["kv2"]
    hf = AutoModelForCausalLM.from_pretrained(entry["path"], torch_dtype=torch.float32)
    loop = PROMPTS[1][:5] * 5
    prompts = [*PROMPTS, loop]
    want = [hf_greedy(hf, p, 40) for p in prompts]
    processed = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **kw)
        for kw in (
            {"repetition_penalty": 1.4},
            {"frequency_penalty": 0.9, "presence_penalty": 0.3, "logit_bias": {loop[0]: -5.0}},
        )
    ]
    want_processed = [hf_processed(hf, loop, sp) for sp in processed]
    assert all(w != want[-1] for w in want_processed)
    with pytest.raises(ValueError, match="overlap_schedule"):
        LLM(model=str(entry["path"]), tp_size=2, overlap_schedule=True, speculative_tokens=4)
    llm, before = start_engine(
        entry["path"],
        tp_size=2,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES * 2,
        max_prefill_tokens=PREFILL_BUDGET,
        speculative_tokens=4,
    )
    try:
        params = [greedy(40)] * len(prompts) + processed
        outs = [o.token_ids for o in llm.generate([*prompts, loop, loop], params)]
        got, got_processed = outs[: len(prompts)], outs[len(prompts) :]
        assert_same(got, want, "TP 2 with drafts vs Hugging Face")
        assert_same(got_processed, want_processed, "TP 2 with penalties vs Hugging Face")
        stats = llm.engine.stats()
        assert stats["accepted_draft_tokens"] > 0
        assert stats["draft_tokens"] > stats["accepted_draft_tokens"]
    finally:
        shutdown_and_check(llm, before)


# -- 4: the StepPlan is a delta -------------------------------------------------------------


def decode_plan_sizes(batch: int, context: int, steps: int = 20) -> list[int]:
    """Pickled sizes of `steps` consecutive decode plans of `batch` requests whose prompts
    are `context` tokens long (one prefill step, then decode across page boundaries)."""
    ps = 16
    max_seq_len = context + steps + 16
    cfg = SchedulerConfig(
        num_pages=batch * (max_seq_len // ps + 2),
        page_size=ps,
        max_running_reqs=batch,
        max_prefill_tokens=batch * context,
        max_seq_len=max_seq_len,
        cache_policy="radix",
    )
    sched = Scheduler(cfg, eos_token_ids=[0])
    ex = HashChainExecutor(
        (cfg.num_pages + 1) * ps, batch, sched.table.page_table.shape[1], vocab_size=VOCAB
    )
    rng = random.Random(batch)
    for rid in range(batch):
        prompt = [rng.randrange(1, VOCAB) for _ in range(context)]
        sched.add_request(rid, prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    plan = sched.step()
    assert plan.num_tokens == batch * context  # the whole batch prefilled in one step
    sched.process_result(ex.execute(plan))
    sizes = []
    for _ in range(steps):
        plan = sched.step()
        assert plan.batch_size == batch and plan.num_tokens == batch
        assert plan.fill_ids.size == 0 and not plan.table_writes and not plan.admitted
        sizes.append(len(pickle.dumps(plan)))
        sched.process_result(ex.execute(plan))
    sched.check_integrity()
    return sizes


def test_decode_plan_size_grows_with_batch_not_context() -> None:
    sizes = {(b, c): decode_plan_sizes(b, c) for b in (8, 64) for c in (64, 1024)}
    assert sizes[8, 64] == sizes[8, 1024]
    assert sizes[64, 64] == sizes[64, 1024]
    # Each extra request adds its row, start, length, out_loc slot, fill length (int32
    # each) and sample flag: 21 bytes, whatever its context.
    for small, large in zip(sizes[8, 64], sizes[64, 64], strict=True):
        assert large - small >= (64 - 8) * 21
    # And it stays small: well under 64 bytes per running request.
    assert max(sizes[64, 1024]) < 64 * 64


# -- 5: losing a worker in the middle of generation -----------------------------------------

KILL_PROMPTS = _prompts(8, seed=11, lens=[9, 30, 17, 4, 26, 12, 21, 6])
KILL_NEW = 40
# Grammar-constrained requests in the same batch, greedy and seeded: a long pattern, so
# they are still running when the worker dies, and each rebuilt worker's matcher must
# re-advance over the tokens the request already has.
KILL_CONSTRAINED = [
    SamplingParams(
        temperature=temperature,
        seed=5,
        max_tokens=KILL_NEW,
        stop_token_ids=(2,),
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{3,8}){30,90}"),
    )
    for temperature in (0.0, 1.0)
]


@pytest.fixture(scope="module")
def kill_refs(tiny) -> list[list[int]]:
    """The in-process TP 1 outputs of KILL_PROMPTS (greedy), then of KILL_CONSTRAINED."""
    tp1 = tiny["kv2"]["tp1"]
    free = [o.token_ids for o in tp1.generate(KILL_PROMPTS, greedy(KILL_NEW))]
    prompts = [KILL_PROMPTS[1]] * len(KILL_CONSTRAINED)
    return free + [o.token_ids for o in tp1.generate(prompts, KILL_CONSTRAINED)]


def collect(engine: Any, rids: list[int], out: dict[int, list[int]], done: set[int]) -> None:
    """One poll: append tokens, note finished requests; an error event fails the test."""
    for ev in engine.poll([r for r in rids if r not in done], timeout_s=1.0):
        assert ev.error is None, f"request {ev.rid} failed: {ev.error}"
        assert ev.rid not in done, f"event after request {ev.rid} finished"
        if ev.token_id is not None:
            out[ev.rid].append(ev.token_id)
        if ev.finished:
            assert ev.finish_reason.value in ("length", "stop")  # stop: a grammar completed
            done.add(ev.rid)


@pytest.mark.parametrize("dispatch", ["compiled_graph", "step_channel", "actor_calls"])
def test_worker_killed_mid_generation(kvray_ray_cluster, tiny, kill_refs, dispatch) -> None:
    """Compiled as on GPUs (two steps in flight when the worker dies), step channels as on
    CPUs (one; the dead rank's socket closes), or actor calls."""
    compiled = dispatch == "compiled_graph"
    llm, before = start_engine(
        tiny["kv2"]["path"],
        tp_size=2,
        compiled=compiled,
        overlap_schedule=compiled,
        step_channel=dispatch == "step_channel",
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_prefill_tokens=64,
    )
    try:
        engine = llm.engine
        # Undisturbed on this engine first.
        calm = [o.token_ids for o in llm.generate(KILL_PROMPTS, greedy(KILL_NEW))]
        assert_same(calm, kill_refs[: len(KILL_PROMPTS)], "TP 2 before the kill vs in-process TP 1")
        assert engine.stats()["recoveries"] == 0
        assert engine.stats()["step_dispatch"] == dispatch

        rids = [engine.submit(p, greedy(KILL_NEW)) for p in KILL_PROMPTS]
        rids += [engine.submit(KILL_PROMPTS[1], sp) for sp in KILL_CONSTRAINED]
        out: dict[int, list[int]] = {r: [] for r in rids}
        done: set[int] = set()
        deadline = time.monotonic() + 60
        while not any(out.values()):
            assert time.monotonic() < deadline, "no token arrived"
            collect(engine, rids, out, done)
        assert len(done) < len(rids), "everything finished before the kill"
        tokens_at_kill = sum(map(len, out.values()))
        engine.kill_worker(1)

        deadline = time.monotonic() + 180
        while len(done) < len(rids):
            assert time.monotonic() < deadline, f"only {len(done)} of {len(rids)} finished"
            collect(engine, rids, out, done)
        assert tokens_at_kill < KILL_NEW * len(rids)
        assert_same([out[r] for r in rids], kill_refs, "after losing a worker")
        assert engine.stats()["recoveries"] >= 1
        assert engine.stats()["step_dispatch"] == dispatch  # the rebuilt group's too
        assert [tuple(s) for s in engine.kv_buffer_shapes()] == [expected_kv_shape(2, 2, 2, 8)] * 2

        # The rebuilt group serves new work.
        again = llm.generate(KILL_PROMPTS[:3], greedy(KILL_NEW))
        assert_same([o.token_ids for o in again], kill_refs[:3], "a request after recovery")
    finally:
        shutdown_and_check(llm, before)


# -- 6: nothing is left in the cluster ------------------------------------------------------


@pytest.mark.parametrize("how", ["scheduler_killed", "llm_dropped"])
def test_engine_lost_without_shutdown_releases_its_placement_group(
    kvray_ray_cluster, tiny, how
) -> None:
    entry = tiny["kv2"]
    before = cluster_snapshot()
    llm = LLM(
        model=str(entry["path"]),
        tp_size=2,
        dtype="float32",
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        progress=False,
    )
    assert llm.generate(PROMPTS[0], greedy(4))[0].token_ids == entry["hf"][0][:4]
    if how == "scheduler_killed":
        ray.kill(llm.engine.actor)  # the scheduler crashed: its shutdown call cannot run
        llm.shutdown()
    else:
        del llm  # the actor handle goes out of scope: Ray ends the SchedulerActor
        gc.collect()
    left_actors, left_pgs = wait_released(before, timeout_s=10)
    remove_placement_groups(left_pgs)  # give the bundles back to the rest of the session
    assert not left_actors, f"actors left alive: {sorted(left_actors)}"
    assert not left_pgs, f"placement groups left behind: {sorted(left_pgs)}"


def kvray_actors_alive() -> set[str]:
    """Class names of the kvray actors alive in the cluster."""
    try:
        from ray.util.state import list_actors

        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
        names = {a.class_name for a in alive}
    except Exception:  # noqa: BLE001 - a cluster started without a dashboard
        from ray._private import state

        names = {a["ActorClassName"] for a in state.actors(actor_state_name="ALIVE").values()}
    return names & {"SchedulerActor", "WorkerActor"}


@pytest.fixture(scope="module", autouse=True)
def cluster_left_empty() -> Iterator[None]:
    """Torn down after every other fixture of this module (its engines included): no
    kvray actor and no placement group is left in the cluster. A failure here shows as an
    error in the teardown of the module's last test."""
    pgs_before = live_placement_groups() if ray.is_initialized() else set()
    yield
    if not ray.is_initialized():
        return
    deadline = time.monotonic() + 20
    while True:
        left, pgs = kvray_actors_alive(), live_placement_groups() - pgs_before
        if not left and not pgs:
            return
        assert time.monotonic() < deadline, f"left behind: actors {left}, placement groups {pgs}"
        time.sleep(0.2)


def test_dispatch_defaults_by_device() -> None:
    """Unset, steps go over a compiled graph on GPUs only (its reads busy-wait a core,
    which CPU workers need for compute); an explicit choice always wins."""
    from kvray.cluster.ray_executor import dispatch_compiled

    assert dispatch_compiled(None, "cuda") and dispatch_compiled(None, "cuda:1")
    assert not dispatch_compiled(None, "cpu")
    assert dispatch_compiled(True, "cpu") and not dispatch_compiled(False, "cuda")
