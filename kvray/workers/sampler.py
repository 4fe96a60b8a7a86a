"""The batched sampler every TP rank runs identically on the all-gathered logits.

Per row: greedy (temperature 0: argmax, ties to the lowest id) or temperature sampling
restricted by min_p, top_k and top_p (applied in that order, as vLLM does), vectorised
across the batch. A sampled row inverts the CDF of its filtered distribution at one uniform
number, and that number is a pure function of the row's (seed, position) (a 64-bit hash,
no generator state). So a request draws the same token whatever its batch mates, on every
rank and in every process.

Logprobs are those of the raw logits (log-softmax at temperature 1, before any filtering),
like vLLM's default; for a row constrained by a grammar, of its masked logits.

A grammar's mask (`TokenBitmask`, from the worker's `GrammarRows`) comes first: it sets the
disallowed tokens of the constrained rows to -inf in place, before greedy argmax and before
temperature, min_p, top_k and top_p, so every filter sees only tokens the grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.core import SamplingParams
from kvray.grammar import TokenBitmask
from kvray.models import fused

# Temperatures below this are treated as greedy: dividing by them overflows float32.
MIN_TEMPERATURE = 1e-5
# top_k / top_p rank only this many best tokens per row (a partial sort) when that suffices.
CANDIDATES = 256
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleOutput:
    """One sampled token per row of the logits, in row order."""

    token_ids: np.ndarray  # int32 [S]
    # float32 [S], log-softmax of the raw logits at token_ids; None when not asked for
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None  # int32 [S, k], most likely first
    top_logprobs: np.ndarray | None = None  # float32 [S, k], descending


@dataclass(frozen=True)
class DeviceSample:
    """`SampleOutput` as tensors on the logits' device (no host sync)."""

    token_ids: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None = None  # float32 [S]; None when no row asked for them
    top_ids: torch.Tensor | None = None  # int64 [S, k]
    top_logprobs: torch.Tensor | None = None  # float32 [S, k]

    def numpy(self) -> SampleOutput:
        """Copy to host as int32 / float32 numpy arrays (one device sync)."""
        top_ids: np.ndarray | None = None
        top_logprobs: np.ndarray | None = None
        if self.top_ids is not None and self.top_logprobs is not None:
            top_ids = _host(self.top_ids, np.int32)
            top_logprobs = _host(self.top_logprobs, np.float32)
        return SampleOutput(
            token_ids=_host(self.token_ids, np.int32),
            logprobs=None if self.logprobs is None else _host(self.logprobs, np.float32),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
        )


def _host(t: torch.Tensor, dtype: type[np.generic]) -> np.ndarray:
    return t.detach().cpu().numpy().astype(dtype, copy=False)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit hash of (seed, position): the randomness of one draw."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def uniform_draw(seed: int, position: int) -> float:
    """The uniform number in (0, 1] that decides the token of request `seed` at `position`
    (53 bits from `mix_seed`; the same on every host, device and process)."""
    return ((mix_seed(seed, position) >> 11) + 1) * 2.0**-53


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def sample_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    max_top_logprobs: int = 0,
    with_logprobs: bool = True,
    token_bitmask: TokenBitmask | None = None,
    raw_logits: torch.Tensor | None = None,
) -> DeviceSample:
    """Sample one token per row of `logits` [S, V] (float32; other dtypes are upcast),
    leaving the results on the logits' device (`.numpy()` copies them to the host).

    `seeds[i]` is request i's seed (its `SamplingParams.seed`, or one the engine assigned)
    and `positions[i]` the position of the token being sampled: together they fix the draw.
    `max_top_logprobs` > 0 also returns that many most likely tokens per row. Without
    `with_logprobs` (and no top logprobs) the chosen tokens' logprobs are not computed: that
    saves a full-vocabulary reduction per row, and `logprobs` is None. `token_bitmask`
    restricts its rows to the tokens their grammars allow (in place, before anything).
    Logprobs are the model's (before temperature and top-k/p, as vLLM's default raw
    logprobs): those of `raw_logits` (float32, masked by the grammars too) when given, the
    logits before logit processing (bias, min_tokens, penalties) changed `logits`."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [S, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if not (len(params) == len(seeds) == len(positions) == num_rows):
        raise ValueError(
            f"{num_rows} logits rows but {len(params)} params, {len(seeds)} seeds, "
            f"{len(positions)} positions"
        )
    for masked in (logits, raw_logits):
        if masked is None or token_bitmask is None:
            continue
        if not fused.mask_rows_(masked, token_bitmask.bitmask, token_bitmask.indices):
            token_bitmask.apply_(masked)
    # Greedy: the first (lowest) id of each row's maximum. Read in the logits' own dtype:
    # upcasting is exact, so it cannot change the winner, and the copy is skipped when no
    # row needs float32 below (all greedy, no logprobs).
    token_ids = fused.argmax_rows(logits)

    random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if random_rows:  # the all-greedy fast path skips everything below
        logits = logits.float()
        if len(random_rows) == num_rows:
            token_ids = _sample_random(logits, params, seeds, positions)
        else:
            idx = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
            token_ids[idx] = _sample_random(
                logits.index_select(0, idx),
                [params[i] for i in random_rows],
                [seeds[i] for i in random_rows],
                [positions[i] for i in random_rows],
            )

    k = min(max_top_logprobs, vocab)
    if not with_logprobs and k <= 0:
        return DeviceSample(token_ids)
    logits = logits.float() if raw_logits is None else raw_logits
    # log p(token) = logit - logsumexp(logits): one reduction, no [S, V] log-softmax copy.
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, token_ids[:, None]) - log_z).squeeze(1)
    if k <= 0:
        return DeviceSample(token_ids, chosen)
    top = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    return DeviceSample(token_ids, chosen, top.indices, top.values - log_z)


def _sample_random(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    """Sample every row (all non-greedy) from its temperature-scaled, filtered softmax."""
    num_rows, vocab = logits.shape
    device = logits.device
    knobs = torch.tensor(
        [
            (p.temperature, min(p.top_k, vocab) if p.top_k > 0 else vocab, p.top_p, p.min_p)
            for p in params
        ],
        dtype=torch.float32,
    ).to(device)
    temperature, top_k, top_p, min_p = knobs.unbind(dim=1)
    uniform = torch.tensor(
        [uniform_draw(int(s), int(p)) for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.float64,
    ).to(device)
    scaled = logits / temperature[:, None]
    if any(p.min_p > 0.0 for p in params):
        # min_p first (as vLLM): drop p < min_p * p_max, i.e. logit < max + log(min_p).
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))

    ranked = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not ranked:
        return _inverse_cdf(scaled, uniform)
    out = torch.empty(num_rows, dtype=torch.long, device=device)
    ranked_set = set(ranked)
    plain = [i for i in range(num_rows) if i not in ranked_set]
    if plain:
        rows = torch.tensor(plain, dtype=torch.long, device=device)
        out[rows] = _inverse_cdf(scaled[rows], uniform[rows])
    rows = torch.tensor(ranked, dtype=torch.long, device=device)
    out[rows] = _sample_ranked(scaled[rows], top_k[rows], top_p[rows], uniform[rows])
    return out


def _sample_ranked(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """top_k / top_p sampling. Rows are ranked by (logit descending, id ascending), so the
    most likely token always survives and top_k=1 or a tiny top_p equal greedy. Only the
    best `CANDIDATES` tokens are ranked at first (a partial sort); rows whose kept set might
    reach past them are re-done with 16x more, then with a full sort. Which level completes
    a row depends on that row alone, never on its batch mates."""
    vocab = scaled.shape[1]
    lse = torch.logsumexp(scaled, dim=-1)
    out = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    todo = torch.arange(scaled.shape[0], device=scaled.device)
    levels = [k for k in (CANDIDATES, 16 * CANDIDATES) if 2 * k < vocab] + [vocab]
    for k in levels:
        x, tk, tp = scaled[todo], top_k[todo], top_p[todo]
        vals, ids = _ranked(x, k)
        keep = _keep_mask(vals, tk, tp, lse[todo], vocab)
        pick = _inverse_cdf(vals.masked_fill(~keep, float("-inf")), uniform[todo])
        pick = ids.gather(1, pick[:, None]).squeeze(1)
        if k == vocab:
            out[todo] = pick
            break
        # Complete only if the kept set ends before the last candidate, strictly above the
        # largest logit left out, and the top_k normaliser is known (top_k < k, or off).
        kept_min = vals.masked_fill(~keep, float("inf")).amin(dim=-1)
        complete = ~keep[:, -1] & (kept_min > vals[:, -1]) & ((tk < k) | (tk >= vocab))
        out[todo[complete]] = pick[complete]
        todo = todo[~complete]
        if todo.numel() == 0:
            break
    return out


def _ranked(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values per row and their ids, by value descending then id ascending."""
    if k >= x.shape[1]:
        return x.sort(dim=-1, descending=True, stable=True)
    vals, ids = x.topk(k, dim=-1, sorted=False)
    ids, perm = ids.sort(dim=-1)
    vals, perm2 = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, perm2)


def _keep_mask(
    vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Which ranked tokens survive top_k, then top_p (the shortest prefix of the top_k
    survivors whose renormalised probability mass reaches top_p)."""
    rank = torch.arange(vals.shape[1], device=vals.device, dtype=torch.float32)
    keep = (rank[None, :] < top_k[:, None]) & (vals > float("-inf"))
    masked = vals.masked_fill(~keep, float("-inf"))
    # Normaliser of the top_k survivors: the whole row's when top_k is off.
    log_norm = torch.where(top_k >= vocab, lse, torch.logsumexp(masked, dim=-1))
    probs = torch.exp(masked - log_norm[:, None])
    mass_before = probs.cumsum(dim=-1) - probs
    # The first ranked token always survives top_p, even one that rounds to 0 in float32.
    cut = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None] & (rank[None, :] > 0)
    return keep & ~cut


def _inverse_cdf(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn from softmax(x) per row (-inf entries never), by inverting the CDF at
    `uniform` in (0, 1]: the first index whose cumulative weight reaches u * total."""
    weights = torch.exp(x - x.amax(dim=-1, keepdim=True)).double()
    cdf = weights.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=x.shape[1] - 1)
