"""The closed-form schedule search equals the plain step-by-step greedy of Eq. 5/6."""

from __future__ import annotations

import random

import pytest

from kairos.core.algorithm import DEFAULT_CHUNK_CANDIDATES, expand_runs, greedy_schedule
from kairos.core.latency import LatencyModels, load_profile

MODELS = load_profile()


def reference_greedy(
    models: LatencyModels, prompt: int, b: int, k: int, cands: tuple[int, ...], budget: float
) -> tuple[list[int], list[float]] | None:
    """Eq. 5 literally: each step, the largest candidate whose step (the final one trimmed to
    what is left) stays within budget; None when no candidate fits."""
    sizes: list[int] = []
    times: list[float] = []
    cached = 0
    while cached < prompt:
        left = prompt - cached
        for chi in cands:
            p = min(chi - b, left)
            if p <= 0:
                continue
            t = models.mixed_step_s(b + p, cached, b, k + cached)
            if t <= budget:
                break
        else:
            return None
        sizes.append(p)
        times.append(t)
        cached += p
    return sizes, times


CASES = [
    (
        random.Random(seed).randint(1, 32768),
        random.Random(seed + 1).randint(0, 140),
        random.Random(seed + 2).randint(0, 600_000),
        random.Random(seed + 3).choice((0.055, 0.063, 0.07, 0.09)),
    )
    for seed in range(0, 1200, 4)
]


@pytest.mark.parametrize(("prompt", "b", "k", "budget"), CASES)
def test_closed_form_greedy_matches_the_step_by_step_greedy(prompt: int, b: int, k: int, budget: float) -> None:
    expected = reference_greedy(MODELS, prompt, b, k, DEFAULT_CHUNK_CANDIDATES, budget)
    got = greedy_schedule(MODELS, prompt, b, k, DEFAULT_CHUNK_CANDIDATES, budget)
    if expected is None:
        assert got == "infeasible"
        return
    assert not isinstance(got, str)
    sizes, times = expand_runs(got[0])
    assert sizes == expected[0]
    assert times == pytest.approx(expected[1], rel=1e-9, abs=1e-12)
    assert got[1] == pytest.approx(sum(expected[1]), rel=1e-9)
