"""The feature vectors of the profile's linear models, built in exactly one place per model.

:mod:`kairos.core.latency` evaluates these models as hand-written scalar dot products on the hot
path; this module builds the same features, vectorised, for the fitter and the checker. The
formulas here mirror ``LatencyModels.prefill_step_s``, ``decode_step_s`` and
``mixed_increment_s`` term by term, in the column order of
``kairos.common.contracts.LINEAR_MODEL_FEATURES``; ``tests/unit/test_profiling_fit.py`` checks that a
``LatencyModels`` built from fitted coefficients reproduces the fitter's own predictions, so the
two cannot drift apart unnoticed.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

Matrix = NDArray[np.float64]


def _col(x: ArrayLike) -> NDArray[np.float64]:
    return np.asarray(x, dtype=np.float64).reshape(-1)


def prefill_features(tokens: ArrayLike, cached: ArrayLike, knee: float) -> Matrix:
    """``prefill_step``: n, max(0, n - knee), n * c (n new tokens over c cached ones)."""
    n, cached_ = _col(tokens), _col(cached)
    return np.column_stack([n, np.maximum(n - knee, 0.0), n * cached_])


def decode_features(decode_tokens: ArrayLike, kv_tokens: ArrayLike) -> Matrix:
    """``decode_step``: B, K."""
    return np.column_stack([_col(decode_tokens), _col(kv_tokens)])


def mixed_features(
    step_tokens: ArrayLike, cached: ArrayLike, decode_tokens: ArrayLike, kv_tokens: ArrayLike, knee: float
) -> Matrix:
    """``mixed_increment``: p, p*B, p*K, p*c, max(0, chi - knee), with p = chi - B prefill tokens.

    The evaluator returns 0 (intercept included) when p <= 0; the fitter only ever feeds rows
    with p > 0 (steps that carry a prefill chunk), where the two agree.
    """
    chi, cached_, b, k = _col(step_tokens), _col(cached), _col(decode_tokens), _col(kv_tokens)
    p = chi - b
    return np.column_stack([p, p * b, p * k, p * cached_, np.maximum(chi - knee, 0.0)])
