"""kvray.scheduler: page accounting, prefix reuse, chunking, retraction, plans."""

from __future__ import annotations

import dataclasses
import pickle
import random

import numpy as np
import pytest
from hash_chain import HashChainExecutor, reference_tokens
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvray.config import SchedulerConfig
from kvray.core import FinishReason, Req, RequestRejected, SamplingParams
from kvray.scheduler import Scheduler
from kvray.scheduler.scheduler import STEP_SECONDS_BUCKETS, STEP_TOKEN_BUCKETS

VOCAB = 40
EOS = 0


def make(
    ps=4,
    num_pages=64,
    policy="radix",
    max_running=16,
    budget=64,
    max_seq_len=512,
    itl=None,
    speculative=0,
):
    cfg = SchedulerConfig(
        num_pages=num_pages,
        page_size=ps,
        max_running_reqs=max_running,
        max_prefill_tokens=budget,
        max_seq_len=max_seq_len,
        cache_policy=policy,
        itl_target_ms=itl,
        speculative_tokens=speculative,
    )
    sched = Scheduler(cfg, eos_token_ids=[EOS])
    ex = HashChainExecutor(
        (num_pages + 1) * ps, max_running, sched.table.page_table.shape[1], VOCAB
    )
    return sched, ex


def run_to_end(sched, ex, overlap=False, max_steps=20_000):
    """Drive the scheduler like an engine; returns {rid: [tokens]} and checks integrity."""
    outs: dict[int, list[int]] = {}
    pending = []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        plan = sched.step()
        if plan is not None:
            pending.append(ex.execute(plan))
        if pending and (plan is None or not overlap or len(pending) > 1):
            for ev in sched.process_result(pending.pop(0)):
                if ev.token_id is not None:
                    outs.setdefault(ev.rid, []).append(ev.token_id)
        sched.check_integrity()
    else:
        raise AssertionError("scheduler did not drain: livelock or deadlock")
    return outs


def rand_prompt(rng, bases, max_len=60):
    base = rng.choice(bases)
    p = base[: rng.randrange(1, len(base) + 1)]
    p = p + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
    return p[:max_len]


def test_seed_worked_examples():
    # page_size=4 with three free pages: free_slots [0, 4, 8] expand to token slots 0..11.
    sched, ex = make(ps=4, num_pages=3, max_seq_len=12)
    cm = sched.cache
    assert cm.free_slots.tolist() == [0, 4, 8]
    assert cm._page_to_token(cm.free_slots).tolist() == list(range(12))
    # A two-request batch: out_loc is page_table[rows, positions] in batch order.
    sched.add_request(0, [5, 6, 7], SamplingParams(max_tokens=2))
    sched.add_request(1, [8, 9, 10, 11, 12], SamplingParams(max_tokens=2))
    plan = sched.step()
    assert plan.extend_lens.tolist() == [3, 5]
    rows = np.repeat(plan.rows, plan.extend_lens)
    positions = np.r_[0:3, 0:5]
    assert np.array_equal(plan.out_loc, sched.table.page_table[rows, positions])
    # Request 0 got one page, request 1 two pages; slots within a page are consecutive.
    assert plan.out_loc[0] % 4 == 0 and plan.out_loc[:3].tolist() == list(
        range(plan.out_loc[0], plan.out_loc[0] + 3)
    )
    assert sorted({int(s) // 4 for s in plan.out_loc}) == [0, 1, 2]
    assert plan.fill_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    sched.process_result(ex.execute(plan))
    run_to_end(sched, ex)
    sched.flush_cache()
    assert sched.is_idle_and_empty()


def test_rejects_requests_that_can_never_fit():
    sched, _ = make(ps=4, num_pages=4, max_seq_len=64)  # the pool holds 16 tokens
    with pytest.raises(RequestRejected, match="exceeds") as err:
        sched.add_request(0, list(range(1, 11)), SamplingParams(max_tokens=7))
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(1, [], SamplingParams())
    sched.add_request(2, list(range(1, 11)), SamplingParams(max_tokens=6))  # 16 fits
    assert not sched.reqs.keys() - {2}


def test_checks_a_prompt_once_against_the_engines_limits():
    """The one prompt check both front ends rely on: the field it names is what the
    server's 400 names (a prompt that leaves no room is the prompt's fault)."""
    cfg = SchedulerConfig(num_pages=4, page_size=4, max_seq_len=64, max_prefill_tokens=16)
    sched = Scheduler(cfg, eos_token_ids=[EOS], vocab_size=VOCAB)  # the pool holds 16 tokens
    for bad in ([1, VOCAB], [-1], [1, True], [2**40]):
        with pytest.raises(RequestRejected, match="vocabulary") as err:
            sched.add_request(0, bad, SamplingParams(max_tokens=1))
        assert err.value.param == "prompt"
    with pytest.raises(RequestRejected, match="no room") as err:
        sched.add_request(0, [1] * 16, SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(RequestRejected, match="exceeds") as err:
        sched.add_request(0, [1] * 15, SamplingParams(max_tokens=2))
    assert err.value.param == "max_tokens"
    assert not sched.reqs
    sched.add_request(0, [1] * 15, SamplingParams(max_tokens=1))


def test_decode_grows_page_by_page_and_retracts_instead_of_reserving():
    # Four requests that each need the whole pool eventually: all are admitted at once
    # (nothing reserved up front), the pool runs dry, the newest are retracted, and every
    # request still finishes with exactly the tokens it would have produced alone.
    sched, ex = make(ps=4, num_pages=8, max_seq_len=32)
    prompts = [[7, 1 + i, 3, 4] for i in range(4)]
    for rid, p in enumerate(prompts):
        sched.add_request(rid, p, SamplingParams(max_tokens=28, ignore_eos=True))
    plan = sched.step()
    assert len(sched.running) == 4 and plan.batch_size == 4
    first = {ev.rid: ev.token_id for ev in sched.process_result(ex.execute(plan))}
    outs = run_to_end(sched, ex)
    assert sched.stats.num_preemptions > 0
    for rid, p in enumerate(prompts):
        assert [first[rid], *outs[rid]] == reference_tokens(p, 28, VOCAB, frozenset())
    sched.flush_cache()
    assert sched.is_idle_and_empty()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_prefix_reuse_computes_only_the_new_tail(ps):
    rng = random.Random(ps)
    shared = [rng.randrange(1, VOCAB) for _ in range(200)]
    second = shared + [rng.randrange(1, VOCAB) for _ in range(37)]
    results = {}
    for policy in ("radix", "naive"):
        sched, ex = make(ps=ps, num_pages=1024 // ps, policy=policy, budget=64)
        sched.add_request(0, shared + [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
        run_to_end(sched, ex)
        req = sched.add_request(1, second, SamplingParams(max_tokens=8, ignore_eos=True))
        results[policy] = run_to_end(sched, ex)[1]
        results[policy + "_computed"] = req.num_computed_prefill
    assert results["radix_computed"] <= len(second) - 200 + ps
    assert results["naive_computed"] == len(second)
    assert results["radix"] == results["naive"] == reference_tokens(second, 8, VOCAB, frozenset())


def test_chunked_prefill_respects_the_token_budget():
    sched, ex = make(ps=4, budget=16)
    prompt = list(range(1, 51))
    sched.add_request(0, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add_request(1, [9, 9, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    outs: dict[int, list[int]] = {}
    while sched.has_work:
        plan = sched.step()
        prefill = int(plan.fill_lens.sum())
        assert prefill <= 16
        for ev in sched.process_result(ex.execute(plan)):
            outs.setdefault(ev.rid, []).append(ev.token_id)
        sched.check_integrity()
    assert outs[0] == reference_tokens(prompt, 5, VOCAB, frozenset())
    assert outs[1] == reference_tokens([9, 9, 9], 5, VOCAB, frozenset())


def test_abort_anywhere_frees_everything():
    sched, ex = make(ps=4, num_pages=32)
    for rid in range(6):
        sched.add_request(rid, [1, 2, 3, 4, 5, 6, rid + 1], SamplingParams(max_tokens=50))
    plan = sched.step()  # all admitted
    sched.process_result(ex.execute(plan))
    plan = sched.step()  # a decode step in flight
    ev = sched.abort(2)
    assert ev.finish_reason is FinishReason.ABORT
    assert sched.abort(2) is None  # already gone
    sched.check_integrity()
    sched.process_result(ex.execute(plan))  # the in-flight token of 2 is dropped
    for rid in (0, 1, 3, 4, 5):
        sched.abort(rid)
    sched.check_integrity()
    assert not sched.has_work
    sched.flush_cache()
    assert sched.is_idle_and_empty()


def test_plan_is_a_delta_whose_size_grows_with_batch_not_context():
    def decode_plan_bytes(batch, context):
        sched, ex = make(
            ps=16,
            num_pages=(batch * (context + 64)) // 16 + 16,
            max_running=batch,
            budget=batch * context,
            max_seq_len=context + 64,
        )
        for rid in range(batch):
            prompt = [1 + rid % 30] + [(rid * 7 + i) % 39 + 1 for i in range(context - 1)]
            sched.add_request(rid, prompt, SamplingParams(max_tokens=32, ignore_eos=True))
        sched.process_result(ex.execute(sched.step()))  # prefill
        plan = sched.step()  # decode
        assert plan.fill_ids.size == 0 and not plan.table_writes and not plan.admitted
        return len(pickle.dumps(plan))

    small, long = decode_plan_bytes(8, 64), decode_plan_bytes(8, 1024)
    assert small == long
    # Each extra decoding request adds its row, start, length, slot, fill length and
    # sample flag: at least 16 bytes, whatever its context.
    assert decode_plan_bytes(64, 64) - small >= 56 * 16


def test_finished_request_counts_and_cache_hits():
    sched, ex = make(ps=4)
    p = [3] * 21
    sched.add_request(0, p, SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_end(sched, ex)
    sched.add_request(1, p, SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_end(sched, ex)
    assert sched.stats.prefix_query_tokens == 42
    assert sched.stats.prefix_hit_tokens == 20  # 21 - 1 tokens, aligned down to pages
    assert sched.stats.num_finished == 2


def test_each_step_is_counted_in_the_step_histograms():
    """`iteration_tokens_total` and `step_compute_seconds` (/metrics) come from these: one
    observation per settled step, of the tokens it computed and the time the worker says
    it took (none where a worker measured none)."""
    sched, ex = make(ps=4, budget=16)
    sched.add_request(0, list(range(1, 51)), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add_request(1, [9, 9, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    sizes, times = [], []
    while sched.has_work:
        plan = sched.step()
        sizes.append(int(plan.extend_lens.sum()))
        result = ex.execute(plan)
        if len(sizes) % 2:  # every other step with a time, as a worker measures it
            times.append(0.003 * len(sizes))
            result = dataclasses.replace(result, compute_s=times[-1])
        sched.process_result(result)
    st = sched.stats
    assert st.steps == len(sizes) and sum(sizes) == st.prefill_tokens + st.decode_tokens
    assert st.step_tokens_sum == sum(sizes)
    bounds = STEP_TOKEN_BUCKETS
    assert st.step_tokens_buckets == [sum(n <= b for n in sizes) for b in bounds] + [len(sizes)]
    assert st.step_compute_seconds_sum == pytest.approx(sum(times))
    bounds = STEP_SECONDS_BUCKETS
    expected = [sum(t <= b for t in times) for b in bounds] + [len(times)]
    assert st.step_compute_seconds_buckets == expected
    assert len(set(expected)) > 2  # the times spread over several buckets


# -- the property test -------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("policy", ["radix", "naive"])
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_sequences_keep_every_invariant(ps, policy, data):
    pool_tokens = data.draw(st.integers(48, 192), label="pool_tokens")
    num_pages = max(pool_tokens // ps, 3)
    sched, ex = make(
        ps=ps,
        num_pages=num_pages,
        policy=policy,
        max_running=data.draw(st.integers(1, 6), label="rows"),
        budget=data.draw(st.integers(1, 48), label="budget"),
        max_seq_len=96,
        # An inter-token-latency target over synthetic step times (1 ms + 1 ms a token):
        # none, one that bites beside a few decodes, one that holds prefill to its minimum.
        itl=data.draw(st.sampled_from([None, 20.0, 1e-3]), label="itl_target_ms"),
        # n-gram drafts for the greedy requests (checked by the executor as a worker does)
        speculative=data.draw(st.sampled_from([0, 1, 4]), label="speculative_tokens"),
    )
    overlap = data.draw(st.booleans(), label="overlap")
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    bases = [[rng.randrange(1, VOCAB) for _ in range(50)] for _ in range(2)]
    prompts: dict[int, tuple[list[int], SamplingParams]] = {}
    outs: dict[int, list[int]] = {}
    aborted: set[int] = set()
    pending = []
    next_rid = 0
    limit = sched.max_seq_len

    # Pages the cache had evicted when each plan was built: a request that finishes in a
    # plan registers its prefix after that plan (while the next is built, under overlap).
    evicted_after_plan: dict[int, int] = {}

    def take(result):
        for ev in sched.process_result(result):
            if ev.token_id is not None:
                outs.setdefault(ev.rid, []).append(ev.token_id)
            if ev.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and policy == "radix":
                # A finished request's prefix is matched by the next identical prompt,
                # unless memory pressure has evicted it since (LRU may take it at once).
                prompt = prompts[ev.rid][0]
                probe = Req(rid=-1, input_ids=list(prompt), sampling=SamplingParams())
                matched = sched.cache.match_req(probe).cached_len
                if sched.cache.evicted_pages == evicted_after_plan[result.step_id]:
                    assert matched == (len(prompt) - 1) // ps * ps
                else:
                    event("finished prefix evicted before it was probed")

    ops = data.draw(
        st.lists(
            st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
            min_size=20,
            max_size=80,
        ),
        label="ops",
    )
    for op in ops:
        if op == "add":
            prompt = rand_prompt(rng, bases)
            sp = SamplingParams(
                temperature=0.0 if rng.random() < 0.7 else 1.0,
                max_tokens=rng.randrange(1, 40),
                ignore_eos=rng.random() < 0.3,
            )
            if len(prompt) + sp.max_tokens > limit:
                with pytest.raises(RequestRejected):
                    sched.add_request(next_rid, prompt, sp)
            else:
                sched.add_request(next_rid, prompt, sp)
                prompts[next_rid] = (prompt, sp)
            next_rid += 1
        elif op == "step":
            prefilled = sched.stats.prefill_tokens
            plan = sched.step()
            if plan is not None and sched.stats.prefill_tokens > prefilled:
                # a step that computes prompt tokens checks no drafts
                assert plan.num_drafts is None or not plan.num_drafts.any()
            if plan is not None:
                evicted_after_plan[plan.step_id] = sched.cache.evicted_pages
                seconds = 1e-3 * (1 + int(plan.extend_lens.sum()))
                pending.append(dataclasses.replace(ex.execute(plan), compute_s=seconds))
            if pending and (plan is None or not overlap or len(pending) > 1):
                take(pending.pop(0))
        elif op == "abort" and sched.reqs:
            rid = rng.choice(sorted(sched.reqs))
            sched.abort(rid)
            aborted.add(rid)
        sched.check_integrity()
        # The worker's mirror, with the writes journaled for the next plan, agrees with the
        # scheduler's table on every computed position.
        mirror = ex.page_table.copy()
        for w in sched.table.pending_writes:
            mirror[w.row, w.start : w.start + len(w.slots)] = w.slots
        for req in sched.running:
            n, row = req.cached_len, req.table_idx
            assert np.array_equal(mirror[row, :n], sched.table.page_table[row, :n])
    # Drain, then every output must equal what the request produces alone.
    for result in pending:
        take(result)
    for rid, tokens in run_to_end(sched, ex, overlap=overlap).items():
        outs.setdefault(rid, []).extend(tokens)
    for rid, (prompt, sp) in prompts.items():
        stop = frozenset() if sp.ignore_eos else frozenset([EOS])
        ref = reference_tokens(prompt, sp.max_tokens, VOCAB, stop)
        got = outs.get(rid, [])
        if rid in aborted:
            assert got == ref[: len(got)]
        else:
            assert got == ref
    event(f"drafts held: {sched.stats.accepted_draft_tokens > 0}")
    event(f"drafts missed: {sched.stats.draft_tokens > sched.stats.accepted_draft_tokens}")
    event(f"retracted: {sched.stats.num_preemptions > 0}")
    event(f"evicted: {sched.cache.evicted_pages > 0}")
    event(f"finished: {min(sched.stats.num_finished, 10) // 5 * 5}+")
    sched.flush_cache()
    assert sched.is_idle_and_empty()


def test_prefix_export_and_import_leases_keep_the_page_accounting():
    """The scheduler side of a K/V transfer between engines (kvray.cluster.kv_transfer):
    an export locks the cached pages until it ends; an import reserves pages (accounted
    for while in flight), then enters the tree extending the local prefix, or is freed."""
    ps = 4
    holder, _ = make(ps=ps, num_pages=16)
    fetcher, _ = make(ps=ps, num_pages=16)
    ids = list(range(1, 23))  # 5 whole pages + 2 tokens
    slots = holder.cache._page_to_token(holder.cache._allocate(5))
    holder.cache.prefix_cache.insert_prefix(ids, slots)
    holder.check_integrity()
    # the fetcher already holds the first page: it asks for the rest
    own = fetcher.cache._page_to_token(fetcher.cache._allocate(1))
    fetcher.cache.prefix_cache.insert_prefix(ids[:ps], own)
    lease_in = fetcher.cache.lease_import(ids)
    assert lease_in.start == ps
    out = holder.cache.lease_export(ids, lease_in.start)
    assert out is not None and out.tokens == 5 * ps and len(out.pages) == 4
    assert holder.cache.prefix_cache.size_info.protected_size == 5 * ps  # locked
    holder.cache.end_export(out)
    assert holder.cache.prefix_cache.size_info.protected_size == 0
    assert holder.cache.lease_export(ids, 5 * ps) is None  # nothing past what it holds
    free0 = fetcher.cache.num_free_pages
    pages = fetcher.cache.reserve_import(lease_in, len(out.pages))
    assert len(pages) == 4 and fetcher.cache.num_free_pages == free0 - 4
    fetcher.check_integrity()  # reserved pages are accounted for while in flight
    assert fetcher.cache.end_import(lease_in, ids, written=True) == 4 * ps
    fetcher.check_integrity()
    assert fetcher.cache.prefix_cache.match_prefix(ids).cached_len == 5 * ps
    assert fetcher.cache.prefix_cache.size_info.protected_size == 0
    # a failed import frees its pages and unlocks the local prefix
    lease = fetcher.cache.lease_import(ids + [99] * 8)
    fetcher.cache.reserve_import(lease, 2)
    assert fetcher.cache.end_import(lease, ids + [99] * 8, written=False) == 0
    fetcher.check_integrity()
    fetcher.flush_cache()
    assert fetcher.is_idle_and_empty()
    holder.flush_cache()
    assert holder.is_idle_and_empty()


def test_a_step_that_computes_prompt_tokens_checks_no_drafts():
    """Every running stream's next token waits for a step with prompt tokens in it, the
    longest kind; drafts would only add rows to it. The steps around it draft as usual."""
    sched, ex = make(ps=4, speculative=4)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    sched.add_request(0, [5, 6, 7] * 4, sp)
    for _ in range(40):
        plan = sched.step()
        sched.process_result(ex.execute(plan))
        if plan.num_drafts is not None and plan.num_drafts.any():
            break
    else:
        raise AssertionError("request 0 never drafted")
    sched.add_request(1, [9, 8, 7, 6, 5] * 3, sp)
    prefilled = sched.stats.prefill_tokens
    plan = sched.step()  # request 1's prompt beside request 0's decode
    assert sched.stats.prefill_tokens == prefilled + 15
    assert plan.num_drafts is None or not plan.num_drafts.any()
    assert plan.extend_lens.tolist() == [1, 15]
    sched.process_result(ex.execute(plan))
    drafted = sched.stats.draft_tokens
    outs = run_to_end(sched, ex)  # decodes only from here on: they draft again
    assert sched.stats.draft_tokens > drafted
    assert len(outs[1]) == 59  # its first token came from the prompt's step


@pytest.mark.parametrize(
    ("prompt_len", "budget", "chunks"),
    [(256, 192, [128, 128]), (100, 40, [36, 32, 32]), (65, 64, [36, 29]), (64, 64, [64])],
)
def test_a_prompt_longer_than_the_budget_goes_in_even_chunks_beside_decodes(
    prompt_len, budget, chunks
):
    """Beside decodes (which wait for the whole step), a prompt takes the fewest steps the
    budget allows, each as long as the others up to a page (4 tokens here), so the longest
    step is as short as that many steps can make it; without decodes (no one waits, and a
    later step's budget may be smaller) it takes the whole budget. Tokens are the
    reference's."""
    sched, ex = make(ps=4, num_pages=128, budget=budget)
    rng = random.Random(prompt_len)
    short = [rng.randrange(1, VOCAB) for _ in range(4)]
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    sched.add_request(0, short, SamplingParams(max_tokens=40, ignore_eos=True))
    outs: dict[int, list[int]] = {}

    def step() -> int:
        plan = sched.step()
        for ev in sched.process_result(ex.execute(plan)):
            outs.setdefault(ev.rid, []).append(ev.token_id)
        sched.check_integrity()
        return int(plan.fill_lens.sum())  # prompt tokens (a decode row fills 0)

    step()  # the short prompt: request 0 decodes from now on
    sched.add_request(1, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    fills = [step() for _ in chunks]
    assert fills == chunks
    while sched.has_work:
        step()
    assert outs[0] == reference_tokens(short, 40, VOCAB, frozenset())
    assert outs[1] == reference_tokens(prompt, 3, VOCAB, frozenset())
    sched.flush_cache()
    assert sched.is_idle_and_empty()

    alone, _ = make(ps=4, num_pages=128, budget=budget)
    alone.add_request(1, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert int(alone.step().fill_lens.sum()) == min(budget, prompt_len)
