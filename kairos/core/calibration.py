"""A decode node's step-time calibration: how much slower than its latency model it runs.

Every step a node runs gives one ratio r = actual / predicted step time (the prediction is Eq. 4,
the model the dispatcher plans with). :class:`StepCalibration` keeps a decaying estimate of an
upper quantile c of r, and the node reports c in its heartbeat. The dispatcher then plans the
node's schedules against ``beta x tau / c`` instead of ``beta x tau`` (Eq. 5): a step planned at
that budget, predicted ``<= tau / c``, runs ``r x tau / c``, which exceeds tau only when r > c.

The quantile (:data:`kairos.common.defaults.CALIBRATION_QUANTILE`) is 0.99, so that a step
carrying a deflected chunk goes over tau with probability under 1% with no beta to choose:
P(r x predicted > tau) <= P(r > c) = 1 - 0.99 for a step planned at the budget's edge, and the
greedy's steps sit at or below that edge (and the node's guard shrinks a chunk whose step the
batch it actually has would push over it). A lower quantile (the P95 a TBT SLO states) would let
every planned step at the edge break tau 5% of the time; a higher one buys little (the tail
estimate from a few thousand steps gets noisy past 0.99) and costs budget, hence TTFT gain.

No floor at 1.0: a node that runs faster than its model (c < 1: r <= c on 99% of its steps) may
plan steps predicted over tau, because they run under tau by the same argument; a floor would
throw away the headroom that a slow profile leaves on a fast node, and an estimate that errs
low is bounded by the same decay that bounds one that errs high. What bounds it instead is the
histogram's range, :data:`kairos.common.contracts.STEP_CALIBRATION_MIN` to ``_MAX`` (a quarter
to four times the model): past those the profile is wrong, not the node's luck, and the value
saturates (the heartbeat contract rejects anything outside them).

The estimator is pure and clock-free: a fixed log-spaced histogram of r (so memory is bounded,
whatever the number of steps), where each new step weighs ``2 ** (1 / half_life_steps)`` times
the one before it (recent steps weigh more; a step ``half_life_steps`` old counts half). The
quantile is the upper edge of the bin where the cumulative weight reaches ``quantile`` of the
total (conservative by at most one bin, 0.54%), kept up to date as steps arrive, so reading it
is free. Until ``min_samples`` steps are in, it reports no less than its prior, 1.0 (trust the
model) or what a profile's measured error implies (:func:`prior_from_mape`), nor than a normal
tail bound from the steps so far (:attr:`StepCalibration.value`): a node just started is not yet
trusted to be faster than its model, but is at once taken to be slower when its first steps say so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Protocol

from kairos.common import defaults
from kairos.common.contracts import STEP_CALIBRATION_MAX, STEP_CALIBRATION_MIN, Role
from kairos.common.errors import ConfigError
from kairos.core.latency import LatencyModels

BINS_PER_OCTAVE = 128  # bin edges 2 ** (i / 128): 0.54% apart, and 1.0 is an edge (i = 0)
_LOW = round(math.log2(STEP_CALIBRATION_MIN) * BINS_PER_OCTAVE)
_HIGH = round(math.log2(STEP_CALIBRATION_MAX) * BINS_PER_OCTAVE)
_EDGE_TOLERANCE = 1e-9  # in bins
_RESCALE_AT = 1e150  # weights grow instead of decaying; scale them all down past this


class _Chunk(Protocol):
    @property
    def tokens(self) -> int: ...  # prompt tokens of one request in the step
    @property
    def cached(self) -> int: ...  # that request's prompt tokens computed before the step


def predicted_step_s(
    models: LatencyModels, role: Role, decode_tokens: int, kv_tokens: int, chunks: Sequence[_Chunk]
) -> float:
    """A step's time as the latency models predict it, the one prediction every node compares its
    measured steps with (and the simulator's and emulated node's clean step time): the prefill
    model for a prefill node's prefill-only steps, Eq. 4 for every other. Several chunks in one
    step are costed as one over their token-weighted mean cached length."""
    if not chunks and decode_tokens:  # decode-only: Eq. 4's increment is 0.0 (the same float)
        return models.decode_step_s(decode_tokens, kv_tokens)
    p = weighted = 0
    for c in chunks:
        p += c.tokens
        weighted += c.tokens * c.cached
    cached = weighted / p if p else 0.0
    if decode_tokens == 0 and role is Role.PREFILL:
        return models.prefill_step_s(p, cached)
    return models.mixed_step_s(decode_tokens + p, cached, decode_tokens, kv_tokens)


def prior_from_mape(mape: float | None, quantile: float = defaults.CALIBRATION_QUANTILE) -> float:
    """The calibration a profile's held-out mean absolute relative error implies before any
    step is measured: the ``quantile`` of 1 + N(0, sigma) with sigma = sqrt(pi / 2) x MAPE (a
    normal error with that mean absolute value); 1.0 when the error was not measured."""
    if not mape:
        return 1.0
    sigma = math.sqrt(math.pi / 2) * mape
    return min(STEP_CALIBRATION_MAX, max(STEP_CALIBRATION_MIN, 1.0 + NormalDist().inv_cdf(quantile) * sigma))


class StepCalibration:
    """The decaying upper-quantile estimate of actual / predicted step time (module docstring)."""

    __slots__ = (
        "_cum",
        "_growth",
        "_idx",
        "_inc",
        "_m2",
        "_mean",
        "_total",
        "_weights",
        "_z",
        "count",
        "min_samples",
        "prior",
        "quantile",
    )

    def __init__(
        self,
        quantile: float = defaults.CALIBRATION_QUANTILE,
        half_life_steps: float = defaults.CALIBRATION_HALF_LIFE_STEPS,
        min_samples: int = defaults.CALIBRATION_MIN_SAMPLES,
        prior: float = 1.0,
    ) -> None:
        if not (0.5 <= quantile < 1.0):
            raise ConfigError(f"calibration quantile must be in [0.5, 1), got {quantile}")
        if not (half_life_steps >= 1 and math.isfinite(half_life_steps)):
            raise ConfigError(f"calibration half_life_steps must be a finite number >= 1, got {half_life_steps}")
        if min_samples < 1:
            raise ConfigError(f"calibration min_samples must be >= 1, got {min_samples}")
        if not (STEP_CALIBRATION_MIN <= prior <= STEP_CALIBRATION_MAX):
            raise ConfigError(
                f"calibration prior must be in [{STEP_CALIBRATION_MIN}, {STEP_CALIBRATION_MAX}], got {prior}"
            )
        self.quantile = quantile
        self.min_samples = min_samples
        self.prior = prior
        self.count = 0  # steps observed (not decayed)
        self._growth = 2.0 ** (1.0 / half_life_steps)  # each step weighs this much more than the last
        self._weights = [0.0] * (_HIGH - _LOW + 1)  # bin i - _LOW: ratios in (2^((i-1)/128), 2^(i/128)]
        self._inc = 1.0  # the next step's weight
        self._total = 0.0
        self._idx = 0  # the quantile's bin (offset by -_LOW)
        self._cum = 0.0  # weight in bins 0.._idx
        # Warm-up only: the ratios' running mean and sum of squared deviations (Welford), for a
        # normal tail bound while too few steps are in for the histogram's tail to mean anything.
        self._mean = 0.0
        self._m2 = 0.0
        self._z = NormalDist().inv_cdf(quantile)

    def observe(self, predicted_s: float, actual_s: float) -> None:
        """One step: its predicted and its measured time. A step with no valid prediction or
        time (zero, negative, NaN) is skipped."""
        if not (0.0 < predicted_s < math.inf and 0.0 < actual_s < math.inf):  # NaN fails too
            return
        r = actual_s / predicted_s
        # A ratio within 1e-9 of a bin's edge counts in the bin below it: a duration measured as a
        # difference of two clock readings (end - start) rounds off the one it was planned as.
        i = math.ceil(math.log2(r) * BINS_PER_OCTAVE - _EDGE_TOLERANCE)
        j = (_HIGH if i > _HIGH else _LOW if i < _LOW else i) - _LOW
        inc = self._inc
        if inc > _RESCALE_AT:
            self._rescale()
            inc = 1.0
        self._inc = inc * self._growth
        w = self._weights
        w[j] += inc
        total = self._total = self._total + inc
        n = self.count = self.count + 1
        idx, cum = self._idx, self._cum
        if n == 1:
            idx, cum = j, inc
        elif j <= idx:
            cum += inc
        if n <= self.min_samples:
            delta = r - self._mean
            self._mean += delta / n
            self._m2 += delta * (r - self._mean)
        # Move the quantile's bin to the first one where the cumulative weight reaches q x total.
        target = self.quantile * total
        while idx > 0 and cum - w[idx] >= target:
            cum -= w[idx]
            idx -= 1
        while cum < target and idx < len(w) - 1:
            idx += 1
            cum += w[idx]
        self._idx, self._cum = idx, cum

    def _rescale(self) -> None:
        scale = 1.0 / self._inc
        self._weights = [x * scale for x in self._weights]
        self._inc = 1.0
        self._total = sum(self._weights)
        self._cum = sum(self._weights[: self._idx + 1])

    @property
    def estimate(self) -> float:
        """The quantile of actual / predicted over the steps seen (the prior before any)."""
        if self.count == 0:
            return self.prior
        return 2.0 ** ((self._idx + _LOW) / BINS_PER_OCTAVE)

    @property
    def value(self) -> float:
        """What the node reports: the estimate once ``min_samples`` steps are in. Before, the
        largest of the prior, the estimate so far and a normal tail bound from the steps so far
        (mean + z(quantile) x their standard deviation, from 2 steps on): a few steps can show
        the node slower than the prior says, never yet that it is faster (the upper quantile of a
        few samples is about their maximum, which only grows with more, and the tail beyond it
        is what the normal bound stands in for)."""
        n = self.count
        if n >= self.min_samples:
            return self.estimate
        value = max(self.prior, self.estimate)
        if n >= 2:
            tail = self._mean + self._z * math.sqrt(self._m2 / (n - 1))
            value = max(value, min(STEP_CALIBRATION_MAX, tail))
        return value
