"""PrefillBudget: how many prompt tokens one step may compute, under an inter-token-latency
target, and the step-cost model it is computed from.

Every request decoding in a step waits for the whole step before its next token, so a
long prefill chunk in the same step is a long gap in every running stream. With
`itl_target_ms` set, a step that has decodes takes as many prompt tokens as the cost
model says fit in the target (planning one standard deviation on the slow side), in
whole pages, at most `max_prefill_tokens` and at least `min_chunk`: a sixteenth of it,
so that when the decodes alone (nearly) fill the target, new requests are not starved (a
whole chunk still goes through in 16 steps; each then overruns the target by the cost of
that slice, never by a model's error), or one such chunk for every two requests waiting
to start (that the table has rows for) when that is more, so that prompts arriving faster
than one chunk a step admits them do not queue without bound (with a long queue the
target gives way: up to a full chunk a step).
A step without decodes delays nobody's next token and keeps the full `max_prefill_tokens`.

The cost model is linear in what a step computes, learned online from the step times
the worker measures (`StepResult.compute_s`):

    step_ms ~= fixed + per_decode * num_decodes + per_prefill_token * prefill_tokens

It is fitted by recursive least squares with drift, i.e. a Kalman filter on the three
coefficients: each step moves them by its error, weighted by how uncertain they still
are in the direction that step measured. So a coefficient no recent step has informed
(per_prefill_token during a long run of pure decodes) keeps its last value instead of
decaying back to the prior, while drift (the machine's load changes, contexts grow)
keeps every coefficient adaptable. An error beyond 3 sigma is clipped: one freak step (a
GC pause, first-time kernel setup) moves the fit a little, not all the way; a run of them
(a prior far off, a machine that got slower) loosens the fit until it has caught up.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from kvray.config import SchedulerConfig

# Where the fit starts (fixed ms, ms per decode, ms per prefill token): roughly a small
# model on a few CPU cores. Wrong by 10x is fine: the first few steps fix it, and each prior
# is only "about this large" (a standard deviation of 100% of its value).
PRIOR_MS = (10.0, 0.5, 0.5)
# A prompt's least progress per step beside decodes, as a share of max_prefill_tokens. A
# fixed small chunk (32 tokens) starved new requests once the decodes alone filled the
# target (63 steps for a 2,000-token prompt); a floor on prefill's share of the step's
# time instead let a model error in the decode cost become a full chunk. An eighth kept
# a 16-decode step on a 2-core CPU over a 250 ms target that a sixteenth lets it meet.
MIN_CHUNK_SHARE = 1 / 16

# With n requests waiting to start, a step beside decodes takes at least n // 2 minimum
# chunks (and always one): the more prompts queue, the faster they are admitted, so the
# queue stays bounded however fast they arrive. The minimum chunk alone admits a fixed
# number of tokens per step: prompts arriving faster than that (2 req/s of 256 tokens on a
# CPU whose decode steps take 300 ms) queued without bound, TTFT p50 5.8 s. One long
# prompt arriving alone still goes in minimum chunks.
WAITING_PER_CHUNK = 2

_FLOOR_MS = np.array([0.0, 0.0, 1e-5])  # no coefficient is negative; a token costs something
_REL_NOISE = 0.1  # a step's time scatters ~10% around the model's prediction...
_ABS_NOISE_MS = 0.5  # ...plus timer and scheduling jitter
_DRIFT = 0.02  # each coefficient may drift ~2% of its value per step
_CLIP_SIGMAS = 3.0
_INFLATE = 2.0
_MAX_STD = 10.0


def _dot(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...]) -> float:
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _matvec(m: list[list[float]], v: tuple[float, ...]) -> list[float]:
    return [_dot(row, v) for row in m]


def _matmul(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [
        [a[i][0] * b[0][j] + a[i][1] * b[1][j] + a[i][2] * b[2][j] for j in range(3)]
        for i in range(3)
    ]


def _bounded(cov: list[list[float]], coef: list[float], prior: list[float]) -> list[list[float]]:
    """Drift and distrust make no coefficient's standard deviation more than 10 times its
    value: wide enough to follow a machine 30 times slower within a few dozen steps,
    bounded so that steps the model cannot explain (it is linear, the machine is not) do
    not grow the uncertainty without end."""
    shrink = [min(1.0, _MAX_STD * max(coef[i], prior[i]) / math.sqrt(cov[i][i])) for i in range(3)]
    out = [[cov[i][j] * shrink[i] * shrink[j] for j in range(3)] for i in range(3)]
    return [[(out[i][j] + out[j][i]) / 2 for j in range(3)] for i in range(3)]


class StepCostModel:
    """step_ms ~= fixed + per_decode * num_decodes + per_prefill_token * prefill_tokens."""

    def __init__(self, prior_ms: tuple[float, float, float] = PRIOR_MS) -> None:
        self.prior = np.array(prior_ms, dtype=np.float64)
        self.coef = self.prior.copy()
        self.cov = np.diag(self.prior**2)
        self.samples = 0

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per_decode, per_prefill_token), in ms."""
        fixed, per_decode, per_token = self.coef.tolist()
        return fixed, per_decode, per_token

    def predict_ms(self, num_decodes: int, prefill_tokens: int) -> float:
        return float(self.coef @ np.array([1.0, num_decodes, prefill_tokens]))

    def upper_ms(self, num_decodes: int) -> tuple[float, float]:
        """One standard deviation above the fit: the time of `num_decodes` decodes alone,
        and the cost of one prefill token. Planning by these, an unsure fit (a fresh one,
        or one still catching up with a machine that changed) admits less prefill, not
        more; a settled one is sure within a few percent."""
        x = np.array([1.0, num_decodes, 0.0])
        decodes = float(self.coef @ x) + math.sqrt(float(x @ self.cov @ x))
        return decodes, float(self.coef[2]) + math.sqrt(float(self.cov[2, 2]))

    def observe(self, num_decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Learn from one measured step. (It runs after every step, on the path from one
        step's result to the next plan: 3x3 algebra in plain floats is ~10x faster than
        numpy's per-call overhead on arrays this small.)"""
        x = (1.0, float(num_decodes), float(prefill_tokens))
        coef, prior = self.coef.tolist(), self.prior.tolist()
        cov = self.cov.tolist()
        for i in range(3):
            cov[i][i] += (_DRIFT * max(coef[i], prior[i])) ** 2
        pred = _dot(coef, x)
        noise = (_REL_NOISE * max(pred, 0.0) + _ABS_NOISE_MS) ** 2
        err = seconds * 1e3 - pred
        limit = _CLIP_SIGMAS * math.sqrt(_dot(x, _matvec(cov, x)) + noise)
        if abs(err) > limit:
            # Clip it, and trust the fit less: one freak step moves it only a little, but
            # a run of them (the fit is far off, or the machine changed) soon moves it fast.
            err = math.copysign(limit, err)
            cov = [[c * _INFLATE for c in row] for row in cov]
        cov = _bounded(cov, coef, prior)
        cov_x = _matvec(cov, x)
        s = _dot(x, cov_x) + noise
        gain = [c / s for c in cov_x]
        # Joseph's form of the covariance update: stays symmetric positive definite in
        # floating point although the features span 1 to thousands.
        keep = [[float(i == j) - gain[i] * x[j] for j in range(3)] for i in range(3)]
        kc = _matmul(keep, cov)
        self.cov = np.array(
            [
                [
                    _dot(kc[i], keep[j]) + gain[i] * gain[j] * noise  # (K C K^T)_ij
                    for j in range(3)
                ]
                for i in range(3)
            ]
        )
        self.coef = self._at_or_above_floor(
            np.array([c + g * err for c, g in zip(coef, gain, strict=True)])
        )
        self.samples += 1

    def _at_or_above_floor(self, coef: np.ndarray) -> np.ndarray:
        """The coefficients nearest `coef`, measured by the fit's own uncertainty, that
        are all at or above their floors. Clipping each one alone is not enough: a step
        that says "faster" may lower two correlated coefficients below zero while raising
        the third, and clipping only the two would leave the third raised, step after
        step. Pinning some at their floors moves the others as their correlation says
        (the Gaussian conditional mean); of the feasible pinnings, the nearest wins."""
        if (coef >= _FLOOR_MS).all():
            return coef
        precision = np.linalg.inv(self.cov)
        best, best_dist = _FLOOR_MS.copy(), math.inf
        for pins in itertools.product((False, True), repeat=3):
            pin = np.array(pins)
            if not pin.any():
                continue
            free = ~pin
            cand = coef.copy()
            cand[pin] = _FLOOR_MS[pin]
            if free.any():
                shift = np.linalg.solve(self.cov[np.ix_(pin, pin)], _FLOOR_MS[pin] - coef[pin])
                cand[free] = coef[free] + self.cov[np.ix_(free, pin)] @ shift
            if (cand[free] >= _FLOOR_MS[free]).all():
                dist = float((cand - coef) @ precision @ (cand - coef))
                if dist < best_dist:
                    best, best_dist = cand, dist
        return best


class PrefillBudget:
    """The prefill token budget of each step (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_tokens = config.max_prefill_tokens
        self.target_ms = config.itl_target_ms
        self.page_size = config.page_size
        pages = int(self.max_tokens * MIN_CHUNK_SHARE) // self.page_size
        self.min_chunk = min(max(pages, 1) * self.page_size, self.max_tokens)
        self.cost = StepCostModel()

    def tokens(self, num_decodes: int, num_waiting: int = 0) -> int:
        """Prompt tokens a step with `num_decodes` decoding requests may compute, with
        `num_waiting` requests in the queue that have not started."""
        if self.target_ms is None or num_decodes == 0:
            return self.max_tokens
        decodes_ms, per_token = self.cost.upper_ms(num_decodes)
        fit = max(self.target_ms - decodes_ms, 0.0) / per_token
        if fit >= self.max_tokens:
            return self.max_tokens
        chunks = max(1, num_waiting // WAITING_PER_CHUNK)
        floor = min(self.min_chunk * chunks, self.max_tokens)
        return max(int(fit) // self.page_size * self.page_size, floor)

    def observe(self, num_decodes: int, prefill_tokens: int, seconds: float) -> None:
        self.cost.observe(num_decodes, prefill_tokens, seconds)

    def info(self, num_decodes: int, num_waiting: int = 0) -> dict[str, float]:
        """What the budget is now, and the model behind it (for stats and metrics)."""
        fixed, per_decode, per_token = self.cost.coefficients
        return {
            "prefill_budget_tokens": self.tokens(num_decodes, num_waiting),
            "step_fixed_ms": fixed,
            "step_per_decode_ms": per_decode,
            "step_per_prefill_token_ms": per_token,
            "step_cost_samples": self.cost.samples,
        }
