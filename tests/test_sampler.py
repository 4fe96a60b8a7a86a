"""The batched sampler: greedy, filters, per-request reproducible randomness, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray.core import SamplingParams
from kvray.workers import sampler
from kvray.workers.sampler import SampleOutput, mix_seed, sample_device, uniform_draw

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


def sample(*args: object, **kwargs: object) -> SampleOutput:
    """The sampler's results on the host, as the worker copies them."""
    return sample_device(*args, **kwargs).numpy()  # type: ignore[arg-type]


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _draw(row: torch.Tensor, params: SamplingParams, seeds: list[int], pos: list[int]) -> list[int]:
    """Sample the same logits row once per (seed, position) pair, as one batch."""
    n = len(seeds)
    out = sample(row.expand(n, -1).contiguous(), [params] * n, seeds, pos)
    return out.token_ids.tolist()


def test_output_types_and_shapes() -> None:
    logits = _logits(5)
    out = sample(logits, [RANDOM] * 5, list(range(5)), [3] * 5, max_top_logprobs=4)
    assert isinstance(out, SampleOutput)
    assert out.token_ids.dtype == np.int32 and out.token_ids.shape == (5,)
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (5,)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.dtype == np.int32 and out.top_ids.shape == (5, 4)
    assert out.top_logprobs.dtype == np.float32 and out.top_logprobs.shape == (5, 4)
    plain = sample(logits, [RANDOM] * 5, list(range(5)), [3] * 5)
    assert plain.top_ids is None and plain.top_logprobs is None
    empty = sample(torch.zeros(0, VOCAB), [], [], [])
    assert empty.token_ids.shape == (0,) and empty.logprobs.shape == (0,)


def test_greedy_is_argmax() -> None:
    logits = _logits(16)
    out = sample(logits, [GREEDY] * 16, [0] * 16, list(range(16)))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, [7, 3, 40]] = 5.0
    logits[1, [60, 11]] = 1.0
    out = sample(logits, [GREEDY] * 2, [1, 2], [0, 0])
    assert out.token_ids.tolist() == [3, 11]


def test_greedy_ignores_seed_and_position() -> None:
    logits = _logits(4)
    a = sample(logits, [GREEDY] * 4, [1, 2, 3, 4], [0, 1, 2, 3])
    b = sample(logits, [GREEDY] * 4, [9, 9, 9, 9], [5, 5, 5, 5])
    assert a.token_ids.tolist() == b.token_ids.tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, top_p=1e-6, top_k=10),
        SamplingParams(temperature=1.0, top_p=5e-324),  # 0 in float32: still keeps the top
        SamplingParams(temperature=1.0, top_p=1e-45, top_k=1000),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(32, seed=1, scale=0.3)  # flat-ish rows: plain sampling would wander
    greedy = sample(logits, [GREEDY] * 32, [0] * 32, [0] * 32).token_ids
    for seed in range(4):
        out = sample(logits, [params] * 32, [seed * 100 + i for i in range(32)], list(range(32)))
        assert out.token_ids.tolist() == greedy.tolist()


def test_top_k_limits_to_k_most_likely() -> None:
    row = _logits(1, seed=2, scale=0.5)[0]
    allowed = set(row.topk(3).indices.tolist())
    drawn = _draw(row, SamplingParams(temperature=1.0, top_k=3), list(range(300)), [0] * 300)
    assert set(drawn) == allowed


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log()
    # 0.5 < 0.7 so the 2nd token is needed; 0.5 + 0.3 >= 0.7, so the 3rd and 4th are not.
    drawn = _draw(row, SamplingParams(temperature=1.0, top_p=0.7), list(range(400)), [1] * 400)
    assert set(drawn) == {0, 1}


def test_min_p_filters() -> None:
    probs = torch.tensor([0.40, 0.25, 0.19, 0.10, 0.06])
    row = probs.log()
    # min_p 0.5: keep p >= 0.5 * 0.40 = 0.20 -> ids 0 and 1 only.
    drawn = _draw(row, SamplingParams(temperature=1.0, min_p=0.5), list(range(400)), [2] * 400)
    assert set(drawn) == {0, 1}
    everything = _draw(row, RANDOM, list(range(400)), [2] * 400)
    assert set(everything) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("vocab", [VOCAB, 20000])
def test_same_seed_same_token_alone_or_in_any_batch(vocab: int) -> None:
    target = _logits(1, vocab=vocab, seed=3, scale=0.5)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40)
    for seed, pos in [(7, 0), (7, 1), (123456789, 17), (2**63 + 5, 4096), (-3, 2)]:
        alone = sample(target, [params], [seed], [pos]).token_ids[0]
        for trial in range(3):
            others = _logits(8, vocab=vocab, seed=100 + trial)
            batch_params = [
                GREEDY,
                SamplingParams(temperature=0.7),
                SamplingParams(temperature=1.3, top_k=5),
                SamplingParams(temperature=1.0, min_p=0.1),
                SamplingParams(temperature=1.0, top_p=0.5),
                RANDOM,
                GREEDY,
                SamplingParams(temperature=2.0, top_k=2, top_p=0.9),
            ]
            at = trial * 3  # the row's place in the batch moves around
            batch = torch.cat([others[:at], target, others[at:]])
            seeds = [trial * 10 + j for j in range(8)]
            positions = [j * 7 for j in range(8)]
            out = sample(
                batch,
                batch_params[:at] + [params] + batch_params[at:],
                seeds[:at] + [seed] + seeds[at:],
                positions[:at] + [pos] + positions[at:],
            )
            assert out.token_ids[at] == alone


def test_draw_is_a_function_of_seed_and_position() -> None:
    row = _logits(1, seed=4, scale=0.3)[0]
    first = _draw(row, RANDOM, [11] * 32, list(range(32)))
    again = _draw(row, RANDOM, [11] * 32, list(range(32)))
    other = _draw(row, RANDOM, [12] * 32, list(range(32)))
    assert first == again
    assert first != other
    assert len(set(first)) > 5  # positions advance the stream: not one token repeated
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 16


def test_mix_seed_is_stable() -> None:
    # Pinned so every process and rank agrees (no Python hash randomisation involved).
    assert mix_seed(0, 0) == mix_seed(0, 0)
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert 0 <= mix_seed(-1, 10**30) < 2**64
    assert len({mix_seed(s, p) for s in range(50) for p in range(50)}) == 2500
    draws = [uniform_draw(s, p) for s in range(20) for p in range(50)]
    assert all(0.0 < u <= 1.0 for u in draws)
    assert 0.45 < float(np.mean(draws)) < 0.55


@pytest.mark.parametrize("vocab", [5000, 20000])
def test_partial_sort_matches_full_sort(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranking only the best candidates (with fallbacks) picks what a full sort picks."""
    gen = torch.Generator().manual_seed(vocab)
    rows = []
    params = []
    for top_k in (-1, 5, 50, 300, 5000):
        for top_p in (0.3, 0.9, 0.99, 1.0):
            for temperature in (0.5, 1.0, 3.0):
                peaked = torch.randn(vocab, generator=gen)
                peaked[torch.randint(vocab, (30,), generator=gen)] += 8.0
                rows += [peaked, torch.randn(vocab, generator=gen) * 0.2]  # and a flat one
                params += [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 2
    logits = torch.stack(rows)
    n = len(params)
    seeds, positions = list(range(n)), [3 * i for i in range(n)]
    partial = sample(logits, params, seeds, positions).token_ids
    monkeypatch.setattr(sampler, "CANDIDATES", vocab)  # every row: one full sort
    full = sample(logits, params, seeds, positions).token_ids
    np.testing.assert_array_equal(partial, full)


def test_top_k_frequencies_on_large_vocab() -> None:
    row = torch.randn(5000, generator=torch.Generator().manual_seed(9))
    params = SamplingParams(temperature=0.8, top_k=6)
    n = 4000
    drawn = _draw(row, params, [21] * n, list(range(n)))
    top = row.topk(6)
    assert set(drawn) <= set(top.indices.tolist())
    counts = np.array([drawn.count(i) for i in top.indices.tolist()])
    expected = torch.softmax(top.values / 0.8, -1).numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected.round(1), chi2)  # 5 dof, P = 0.001


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_frequencies_match_softmax(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 6000
    drawn = _draw(row, SamplingParams(temperature=temperature), [5] * n, list(range(n)))
    counts = np.bincount(drawn, minlength=row.numel())
    expected = torch.softmax(row / temperature, -1).numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001. Deterministic given the fixed seeds.
    assert chi2 < 24.3, (counts, expected.round(1), chi2)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(6, seed=5)
    params = [
        GREEDY,
        RANDOM,
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.8),
    ]
    out = sample(logits, params, [1, 2, 3, 4, 5, 6], [0] * 6, max_top_logprobs=5)
    ref = torch.log_softmax(logits, -1)
    ids = torch.from_numpy(out.token_ids).long()
    expect = ref.gather(1, ids[:, None]).squeeze(1).numpy()
    np.testing.assert_allclose(out.logprobs, expect, rtol=1e-6, atol=1e-6)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert np.all(np.diff(out.top_logprobs, axis=1) <= 0)
    top = ref.topk(5, dim=-1)
    np.testing.assert_array_equal(out.top_ids, top.indices.numpy())
    np.testing.assert_allclose(out.top_logprobs, top.values.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.top_ids[:, 0], logits.argmax(-1).numpy())


def test_top_logprobs_capped_at_vocab() -> None:
    out = sample(_logits(2, vocab=4), [RANDOM] * 2, [0, 1], [0, 0], max_top_logprobs=10)
    assert out.top_ids is not None and out.top_ids.shape == (2, 4)
    assert sorted(out.top_ids[0].tolist()) == [0, 1, 2, 3]


def test_mismatched_lengths_rejected() -> None:
    with pytest.raises(ValueError):
        sample(_logits(3), [RANDOM] * 2, [0, 1, 2], [0, 0, 0])


def test_logprobs_skipped_unless_asked() -> None:
    logits = _logits(4)
    out = sample(logits, [GREEDY] * 4, list(range(4)), [0] * 4, with_logprobs=False)
    assert out.logprobs is None and out.top_ids is None
    full = sample(logits, [GREEDY] * 4, list(range(4)), [0] * 4)
    np.testing.assert_array_equal(out.token_ids, full.token_ids)
    assert full.logprobs is not None and full.logprobs.shape == (4,)
    # top logprobs bring the chosen ones with them
    top = sample(logits, [GREEDY] * 4, list(range(4)), [0] * 4, 2, with_logprobs=False)
    assert top.logprobs is not None and top.top_ids is not None
