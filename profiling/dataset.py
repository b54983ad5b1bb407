"""Step records as columns, split by the model that costs them; MAPE; a profile's predictions.

Shared by the fitter and the checker, so both measure a profile the same way. The mixed model's
error is measured on whole mixed steps (T0(B, K) + Delta T against the measured duration):
the increment alone can be a few milliseconds, where a percentage error means little, and the
whole step is what the dispatcher compares with the TBT SLO.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kairos.common import contracts as c
from kairos.core.latency import LatencyModels
from kairos.profiling.records import StepKind, StepRecord

# Which step kind each step model is fitted and measured on.
MODEL_KIND = {c.PREFILL_STEP: StepKind.PREFILL, c.DECODE_STEP: StepKind.DECODE, c.MIXED_INCREMENT: StepKind.MIXED}
STEP_MODELS = (c.DECODE_STEP, c.PREFILL_STEP, c.MIXED_INCREMENT)  # fit order: decode before mixed

Floats = NDArray[np.float64]


@dataclass(frozen=True)
class Steps:
    """Columns of a set of step records (all in one order)."""

    run: NDArray[np.str_]  # run id of each row
    duration: Floats  # measured, model seconds
    decode_tokens: Floats  # B
    kv_tokens: Floats  # K
    prefill_tokens: Floats  # p
    step_tokens: Floats  # chi = B + p
    cached: Floats  # token-weighted mean cached length of the chunks

    @classmethod
    def of(cls, records: Iterable[StepRecord]) -> Steps:
        recs = list(records)

        def col(values: Iterable[float]) -> Floats:
            return np.fromiter(values, dtype=np.float64, count=len(recs))

        return cls(
            run=np.array([r.run for r in recs], dtype=np.str_),
            duration=col(r.duration for r in recs),
            decode_tokens=col(r.decode_tokens for r in recs),
            kv_tokens=col(r.kv_tokens for r in recs),
            prefill_tokens=col(r.prefill_tokens for r in recs),
            step_tokens=col(r.step_tokens for r in recs),
            cached=col(r.cached for r in recs),
        )

    def __len__(self) -> int:
        return int(self.duration.size)

    def take(self, idx: NDArray[np.intp] | NDArray[np.bool_]) -> Steps:
        return Steps(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    def without_runs(self, runs: Iterable[str]) -> Steps:
        return self.take(~np.isin(self.run, list(runs)))

    @property
    def runs(self) -> list[str]:
        return sorted(set(self.run.tolist()))


def split_by_model(records: Iterable[StepRecord]) -> dict[str, Steps]:
    """The rows each step model is fitted on (empty steps belong to none)."""
    by_kind: dict[StepKind, list[StepRecord]] = {k: [] for k in StepKind}
    for r in records:
        by_kind[r.kind].append(r)
    return {name: Steps.of(by_kind[kind]) for name, kind in MODEL_KIND.items()}


def mape(predicted: Floats, measured: Floats) -> float:
    """Mean absolute percentage error, as a fraction (0.05 = 5%)."""
    return float(np.mean(np.abs(predicted - measured) / measured))


def profile_predictions(models: LatencyModels, name: str, s: Steps) -> Floats:
    """Step durations the profile predicts for rows of model ``name``, through the dispatcher's
    own evaluator (whole steps for the mixed model)."""
    rows = zip(s.prefill_tokens, s.cached, s.decode_tokens, s.kv_tokens, s.step_tokens, strict=True)
    if name == c.PREFILL_STEP:
        values = (models.prefill_step_s(p, cached) for p, cached, _, _, _ in rows)
    elif name == c.DECODE_STEP:
        values = (models.decode_step_s(b, k) for _, _, b, k, _ in rows)
    else:
        values = (models.mixed_step_s(chi, cached, b, k) for _, cached, b, k, chi in rows)
    return np.fromiter(values, dtype=np.float64, count=len(s))
