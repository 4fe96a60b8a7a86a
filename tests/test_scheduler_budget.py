"""kvray.scheduler.budget: the step-cost model and the prefill budget under an
inter-token-latency target, alone and inside the scheduler.

Step times here are synthetic (a known linear cost, seeded noise), so every assertion is
deterministic; the engine-level parity run with a real model and measured step times is in
test_engine.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hash_chain import HashChainExecutor, reference_tokens

from kvray.config import EngineConfig, SchedulerConfig
from kvray.core import SamplingParams, StepPlan, StepResult
from kvray.scheduler import Scheduler
from kvray.scheduler.budget import PRIOR_MS, PrefillBudget, StepCostModel

TRUE_MS = (12.0, 1.5, 0.8)  # fixed, per decode, per prefill token
VOCAB = 40


def true_ms(d: int, p: int, coef: tuple[float, float, float] = TRUE_MS) -> float:
    return coef[0] + coef[1] * d + coef[2] * p


def feed(model: StepCostModel, rng: random.Random, n: int, coef=TRUE_MS, noise=0.05, shape=None):
    """`n` steps of random shape (pure decodes, pure prefills, mixed) timed by `coef` with
    +-`noise` relative scatter."""
    for _ in range(n):
        if shape is not None:
            d, p = shape
        else:
            kind = rng.random()
            d = 0 if kind < 0.2 else rng.randrange(1, 65)
            p = 0 if 0.2 <= kind < 0.6 else rng.randrange(1, 2049)
        ms = true_ms(d, p, coef) * (1 + rng.uniform(-noise, noise))
        model.observe(d, p, ms / 1e3)


def assert_close(got, want, rel: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


# -- the cost model --------------------------------------------------------------------------


def test_fit_recovers_known_coefficients():
    model = StepCostModel()
    assert model.coefficients == PRIOR_MS  # before any step: the prior
    feed(model, random.Random(0), 400)
    assert_close(model.coefficients, TRUE_MS, rel=0.1)
    assert model.samples == 400
    assert model.predict_ms(16, 512) == pytest.approx(true_ms(16, 512), rel=0.03)


def test_fit_without_noise_is_exact_enough_to_plan_by():
    model = StepCostModel()
    feed(model, random.Random(1), 200, noise=0.0)
    assert_close(model.coefficients, TRUE_MS, rel=0.02)


def test_one_freak_step_moves_the_fit_a_little():
    """A GC pause or first-time setup (30 s) is clipped, then forgotten."""
    rng = random.Random(2)
    model = StepCostModel()
    feed(model, rng, 300)
    before = model.predict_ms(16, 256)
    model.observe(16, 256, 30.0)
    assert model.predict_ms(16, 256) < 1.5 * before
    feed(model, rng, 100)
    assert_close(model.coefficients, TRUE_MS, rel=0.1)


def test_an_unmeasured_coefficient_keeps_its_value():
    """Hours of pure decodes say nothing about prefill: per_prefill_token stays where the
    last prefills put it (it does not decay back to the prior)."""
    rng = random.Random(3)
    model = StepCostModel()
    feed(model, rng, 300)
    feed(model, rng, 3000, shape=(16, 0))
    assert model.coefficients[2] == pytest.approx(TRUE_MS[2], rel=0.1)
    assert model.predict_ms(16, 0) == pytest.approx(true_ms(16, 0), rel=0.03)


def test_the_fit_follows_a_slower_machine():
    rng = random.Random(4)
    model = StepCostModel()
    feed(model, rng, 300)
    slower = tuple(2 * c for c in TRUE_MS)
    feed(model, rng, 150, coef=slower)
    assert_close(model.coefficients, slower, rel=0.1)


def test_the_fit_follows_a_machine_that_gets_faster_again():
    """Steps 30x dearer while another process hogs the cores, then back to normal, with
    the same shapes throughout (16 decodes, with and without a 32-token chunk). The fit
    must come back, not run away: lowering two correlated coefficients below zero while
    raising the third, then clipping only the two, did exactly that."""
    rng = random.Random(7)
    model = StepCostModel()
    feed(model, rng, 300)
    slow = tuple(30 * c for c in TRUE_MS)
    for coef, n in ((slow, 60), (TRUE_MS, 30)):
        for _ in range(n):
            p = rng.choice((0, 32))
            model.observe(16, p, true_ms(16, p, coef) * (1 + rng.uniform(-0.05, 0.05)) / 1e3)
            assert min(model.coefficients) >= 0
        assert model.predict_ms(16, 32) == pytest.approx(true_ms(16, 32, coef), rel=0.1)
    assert model.coefficients[2] == pytest.approx(TRUE_MS[2], rel=0.2)


def test_a_prior_ten_times_off_is_fixed_within_a_few_steps():
    """A GPU's steps are far cheaper than the CPU-sized prior (and a big model's on a CPU
    far dearer): a handful of steps of each shape settle it."""
    for scale in (0.02, 10.0):
        coef = tuple(scale * c for c in TRUE_MS)
        model = StepCostModel()
        feed(model, random.Random(5), 30, coef=coef)
        assert model.predict_ms(16, 512) == pytest.approx(true_ms(16, 512, coef), rel=0.15)


# -- the budget ------------------------------------------------------------------------------


def budget_for(target_ms, *, max_prefill=512, ps=16, coef=(10.0, 2.0, 0.5)) -> PrefillBudget:
    cfg = SchedulerConfig(
        num_pages=64,
        max_seq_len=512,
        page_size=ps,
        max_prefill_tokens=max_prefill,
        itl_target_ms=target_ms,
    )
    budget = PrefillBudget(cfg)
    budget.cost = StepCostModel(prior_ms=coef)
    budget.cost.cov[:] = 0.0  # a model that has learned `coef`, and is sure of it
    return budget


def test_budget_fits_the_target_in_whole_pages():
    budget = budget_for(100.0)
    # (100 - 10 - 2 * 10) / 0.5 = 140 tokens, whole pages of 16: 128
    assert budget.tokens(10) == 128
    assert budget.tokens(20) == 96  # (100 - 10 - 40) / 0.5 = 100 -> 96
    assert budget.tokens(1) < budget_for(200.0).tokens(1)  # a looser target, more prefill
    assert budget_for(100.0, ps=1).tokens(10) == 140


def test_an_unsure_fit_admits_less_prefill():
    """The same coefficients with a prior's uncertainty (100%): the budget plans one
    standard deviation slow, (100 - 30 - sqrt(10^2 + 20^2)) / (2 * 0.5) = 47 tokens, where
    the sure fit allows (100 - 30) / 0.5 = 140."""
    budget = budget_for(100.0, ps=1, max_prefill=256)  # a minimum chunk of 32
    assert budget.tokens(10) == 140
    budget.cost = StepCostModel(prior_ms=(10.0, 2.0, 0.5))
    assert budget.tokens(10) == 47


def test_budget_without_decodes_is_the_full_chunk():
    assert budget_for(100.0).tokens(0) == 512
    assert budget_for(1e-3).tokens(0) == 512


def test_budget_is_capped_at_max_prefill_tokens():
    assert budget_for(1e6).tokens(64) == 512
    assert budget_for(1e6, max_prefill=100).tokens(1) == 100  # not rounded down to pages


def test_budget_always_lets_a_prompt_advance():
    """Decodes that alone fill the target, or a model that says a token costs a second:
    a prompt still gets its minimum chunk, a sixteenth of max_prefill_tokens in whole pages
    (at least one page, at most max_prefill_tokens)."""
    assert budget_for(100.0, max_prefill=2048).tokens(100) == 128
    assert budget_for(100.0).tokens(100) == 32
    assert budget_for(100.0, coef=(10.0, 2.0, 1e3)).tokens(10) == 32
    assert budget_for(1e-3, ps=1, max_prefill=2048).tokens(1) == 128
    assert budget_for(1e-3, max_prefill=100).tokens(1) == 16  # 6 tokens: a page
    assert budget_for(1e-3, ps=256, max_prefill=2048).tokens(1) == 256
    assert budget_for(1e-3, ps=4, max_prefill=8).tokens(1) == 4  # one page
    assert budget_for(1e-3, ps=16, max_prefill=8).tokens(1) == 8  # a page, capped


def test_a_machine_whose_speed_swings_gets_no_big_chunk_beside_decodes():
    """Another process comes and goes (the machine 1x, 3x, 15x, 30x slower, switching
    every ~20 steps) and one step in 200 is a 10x freak: the fit lags behind every switch,
    so the budget errs; planning one standard deviation slow keeps the errors small: 99%
    of the steps beside decodes take under 1.5x the larger of the target and what the
    minimum chunk would take, none over 2x, and none gets half a full chunk."""
    rng = random.Random(8)
    budget = budget_for(250.0, max_prefill=2048)
    budget.cost = StepCostModel()
    slow, ratios = 1.0, []
    for _ in range(5000):
        if rng.random() < 0.05:
            slow = rng.choice((1.0, 1.0, 3.0, 15.0, 30.0))
        d = rng.choice((0, 4, 16, 16, 64))
        p = budget.tokens(d) if rng.random() < 0.7 else 0
        freak = 1 + rng.uniform(-0.1, 0.1) + (10 if rng.random() < 0.005 else 0)
        ms = slow * freak * true_ms(d, p, (60.0, 1.0, 0.6))
        if d and p:
            assert p < 1024
            floor_ms = slow * freak * true_ms(d, budget.min_chunk, (60.0, 1.0, 0.6))
            ratios.append(ms / max(250.0, floor_ms))
        budget.observe(d, p, ms / 1e3)
    ratios.sort()
    assert ratios[int(0.99 * len(ratios))] < 1.5 and ratios[-1] < 2.0


def test_no_target_is_the_old_behaviour():
    budget = budget_for(None)
    assert [budget.tokens(d) for d in (0, 1, 256)] == [512] * 3
    assert EngineConfig().itl_target_ms is None


def test_budget_info_reports_the_model():
    info = budget_for(100.0).info(10)
    assert info["prefill_budget_tokens"] == 128
    assert (info["step_fixed_ms"], info["step_per_decode_ms"]) == (10.0, 2.0)
    assert info["step_per_prefill_token_ms"] == 0.5 and info["step_cost_samples"] == 0


# -- inside the scheduler --------------------------------------------------------------------


def timed(result: StepResult, plan: StepPlan, coef=TRUE_MS) -> StepResult:
    """The hash-chain executor's result, timed as a worker with cost `coef` would time it."""
    decodes = int((plan.fill_lens == 0).sum())
    ms = true_ms(decodes, int(plan.fill_lens.sum()), coef)
    return dataclasses.replace(result, compute_s=ms / 1e3)


def run_steps(sched, ex, steps, arrivals):
    """Steps `sched` on `ex` (timed by TRUE_MS) until it has no work, adding the requests
    `arrivals[step]` = [(rid, prompt, params)] before that step. Returns [(decodes, prefill
    tokens)] per step and each request's tokens."""
    shapes, outs = [], {}
    for step in range(steps):
        for rid, prompt, sp in arrivals.get(step, ()):
            sched.add_request(rid, prompt, sp)
        if not sched.has_work:
            break
        plan = sched.step()
        shapes.append((int((plan.fill_lens == 0).sum()), int(plan.fill_lens.sum())))
        for ev in sched.process_result(timed(ex.execute(plan), plan)):
            outs.setdefault(ev.rid, []).append(ev.token_id)
        sched.check_integrity()
    return shapes, outs


def run_long_prompt_beside_decodes(itl_target_ms):
    """8 requests decode; a 1,200-token prompt arrives. Returns [(decodes, prefill tokens)]
    per step and the outputs (which must be the reference tokens)."""
    cfg = SchedulerConfig(
        num_pages=512,
        page_size=16,
        max_running_reqs=16,
        max_prefill_tokens=512,
        max_seq_len=2048,
        itl_target_ms=itl_target_ms,
    )
    sched = Scheduler(cfg)
    ex = HashChainExecutor(513 * 16, 16, sched.table.page_table.shape[1], VOCAB)
    rng = random.Random(6)
    prompts = {rid: [rng.randrange(1, VOCAB) for _ in range(20)] for rid in range(8)}
    long_prompt = [rng.randrange(1, VOCAB) for _ in range(1200)]
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    for rid, p in prompts.items():
        sched.add_request(rid, p, sp)
    prompts[8] = long_prompt
    arrivals = {20: [(8, long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))]}
    shapes, outs = run_steps(sched, ex, 200, arrivals)
    for rid, p in prompts.items():
        want = reference_tokens(p, 4 if rid == 8 else 60, VOCAB, frozenset())
        assert outs[rid] == want, rid
    return shapes, sched


def test_budget_grows_with_the_queue_so_prompts_cannot_pile_up():
    """Decodes that alone fill the target: one minimum chunk with up to 3 requests waiting
    to start, one more for every second request waiting beyond, at most max_prefill_tokens;
    a budget the target allows anyway is not cut."""
    tight = budget_for(100.0, max_prefill=2048)
    assert [tight.tokens(100, n) for n in (0, 1, 2, 3, 4, 5, 6, 9)] == [
        128,
        128,
        128,
        128,
        256,
        256,
        384,
        512,
    ]
    assert tight.tokens(100, 100) == 2048
    assert tight.tokens(0, 100) == 2048  # nothing decoding: the full chunk anyway
    roomy = budget_for(1e3, max_prefill=2048)  # (1000 - 10 - 2) / 0.5: 1976 tokens fit
    assert roomy.tokens(1, 0) == roomy.tokens(1, 6) == 1968
    assert budget_for(None).tokens(5, 9) == 512


def test_prefill_budget_shrinks_while_decodes_run():
    target = 150.0
    shapes, sched = run_long_prompt_beside_decodes(target)
    # The long prompt's chunks beside 8 decodes: (150 - 12 - 8 * 1.5) / 0.8 = 157 tokens,
    # whole pages of 16: 144 once the model has learned the costs. The prompt takes as
    # few steps as 144-token chunks would (9), evenly sized: no short last chunk.
    mixed = [(d, p) for d, p in shapes[20:] if d and p]
    assert mixed and sum(p for _, p in mixed) == 1200
    assert all(p <= 160 for _, p in mixed), mixed
    assert max(p for _, p in mixed[1:]) == 144 and len(mixed) == -(-1200 // 144), mixed
    assert max(p for _, p in mixed) - min(p for _, p in mixed) <= 16, mixed
    assert all(true_ms(d, p) <= 1.1 * target for d, p in mixed[1:]), mixed
    assert sched.budget.cost.samples == len(shapes)
    assert sched.budget.tokens(0) == 512  # nothing decoding: the full chunk
    # The 8 short prompts arrived together with nothing decoding: one full step.
    assert shapes[0] == (0, 160)


def test_without_a_target_the_long_prompt_takes_as_few_steps_as_full_chunks():
    shapes, _ = run_long_prompt_beside_decodes(None)
    mixed = [p for d, p in shapes[20:] if d and p]
    assert mixed == [400, 400, 400]  # 1,200 tokens under max_prefill_tokens 512: 3 steps


def test_a_burst_of_prompts_beside_decodes_is_admitted_faster_than_one_chunk_a_step():
    """8 requests decode under a target their decodes alone fill; 8 short prompts arrive at
    once. The first step after takes 4 minimum chunks (8 waiting), not one, and every
    output is still the reference."""
    cfg = SchedulerConfig(
        num_pages=512,
        page_size=16,
        max_running_reqs=16,
        max_prefill_tokens=512,  # minimum chunk: 32 tokens
        max_seq_len=2048,
        itl_target_ms=10.0,  # 8 decodes alone take 24 ms
    )
    sched = Scheduler(cfg)
    ex = HashChainExecutor(513 * 16, 16, sched.table.page_table.shape[1], VOCAB)
    rng = random.Random(9)
    prompts = {rid: [rng.randrange(1, VOCAB) for _ in range(20)] for rid in range(16)}
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    for rid in range(8):
        sched.add_request(rid, prompts[rid], sp)
    shapes, outs = run_steps(
        sched, ex, 300, {10: [(rid, prompts[rid], sp) for rid in range(8, 16)]}
    )
    assert shapes[10] == (8, 4 * 32), shapes[8:14]
    for rid, p in prompts.items():
        assert outs[rid] == reference_tokens(p, 30, VOCAB, frozenset()), rid
