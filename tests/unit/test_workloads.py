"""Seeded, exact checks of the synthetic workloads (fixed seeds, so no flaky statistics)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from kairos.traffic.requests import RequestSpec
from kairos.traffic.workloads import (
    COMPLETION_P25,
    COMPLETION_P90,
    PROMPT_P25,
    PROMPT_P90,
    WORKLOAD_NAMES,
    WORKLOADS,
    Geometric,
    LogNormal,
    Quantiles,
    make_workload,
)


def _columns(requests: list[RequestSpec]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrivals = np.array([r.arrival_s for r in requests])
    prompts = np.array([r.prompt_tokens for r in requests])
    outputs = np.array([r.output_tokens for r in requests])
    return arrivals, prompts, outputs


def _realised_rps(arrivals: np.ndarray) -> float:
    return arrivals.size / (arrivals[-1] - arrivals[0])


def _within(actual: float, expected: float, rel: float) -> bool:
    return abs(actual - expected) <= rel * expected


@pytest.fixture(scope="module")
def bursty_50k() -> list[RequestSpec]:
    return make_workload("bursty", rps=None, num_requests=50_000, seed=1234)


def test_registry_names() -> None:
    assert WORKLOAD_NAMES == ("bursty", "lpld", "lphd", "hpld", "hphd", "azure_conv")
    assert all(WORKLOADS[name].name == name for name in WORKLOAD_NAMES)


def test_bursty_prompt_quantiles(bursty_50k: list[RequestSpec]) -> None:
    _, prompts, _ = _columns(bursty_50k)
    p25, p50, p90 = np.percentile(prompts, [25, 50, 90])
    assert _within(p25, 2071, 0.02), p25
    assert _within(p50, 3569, 0.02), p50
    assert _within(p90, 10336, 0.02), p90


def test_bursty_completion_and_arrivals(bursty_50k: list[RequestSpec]) -> None:
    arrivals, prompts, outputs = _columns(bursty_50k)
    assert _within(float(np.median(outputs)), 50, 0.05)
    assert outputs.min() >= 1
    assert (prompts + outputs).max() <= 32768
    assert _within(_realised_rps(arrivals), 4.0, 0.05)
    gaps = np.diff(arrivals)
    assert _within(float(gaps.std() / gaps.mean()), 2.0, 0.10)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_requested_cv_is_realised(cv: float) -> None:
    arrivals, _, _ = _columns(make_workload("bursty", rps=10.0, num_requests=20_000, seed=7, cv=cv))
    gaps = np.diff(arrivals)
    assert _within(float(gaps.std() / gaps.mean()), cv, 0.15)
    assert _within(_realised_rps(arrivals), 10.0, 0.05)


# Table 1: (name, median prompt, median completion, RPS, high prompt?, high decode?)
TABLE_1 = [
    ("lpld", 842, 15, 22.0, False, False),
    ("lphd", 998, 191, 20.0, False, True),
    ("hpld", 14013, 9, 1.0, True, False),
    ("hphd", 13968, 198, 1.0, True, True),
]


@pytest.mark.parametrize(("name", "prompt_median", "completion_median", "rps", "high_p", "high_d"), TABLE_1)
def test_table1_medians_and_rate(
    name: str, prompt_median: int, completion_median: int, rps: float, high_p: bool, high_d: bool
) -> None:
    requests = make_workload(name, rps=None, num_requests=20_000, seed=0)
    arrivals, prompts, outputs = _columns(requests)
    assert _within(float(np.median(prompts)), prompt_median, 0.05), np.median(prompts)
    assert _within(float(np.median(outputs)), completion_median, 0.05), np.median(outputs)
    assert _within(_realised_rps(arrivals), rps, 0.05), _realised_rps(arrivals)
    # Each workload stays inside its stratum of the production distribution.
    if high_p:
        assert prompts.min() > PROMPT_P90
    else:
        assert prompts.max() < PROMPT_P25
    if high_d:
        assert outputs.min() > COMPLETION_P90
    else:
        assert outputs.max() < COMPLETION_P25
    assert outputs.min() >= 1
    assert (prompts + outputs).max() <= 32768


def test_stratum_distribution_medians_are_exact() -> None:
    for name, prompt_median, completion_median, *_ in TABLE_1:
        spec = WORKLOADS[name]
        assert spec.prompt.median == pytest.approx(prompt_median, rel=1e-9)
        assert spec.completion.median == pytest.approx(completion_median, rel=1e-9)
    assert Geometric(1 / 72).median == 50


# Percentiles of AzureLLMInferenceTrace_conv.csv (19,366 requests), the table the workload holds.
AZURE_CONV = [
    # (percent, prompt tokens, output tokens)
    (10, 207, 54),
    (25, 395, 85),  # between the 20 and 30 knots; the trace's own P25s are 396 and 85
    (50, 1020, 129),
    (75, 1189, 395),
    (90, 2735, 424),
    (95, 4083, 451),
]


def test_azure_conv_follows_the_trace_percentiles() -> None:
    requests = make_workload("azure_conv", rps=None, num_requests=50_000, seed=4)
    arrivals, prompts, outputs = _columns(requests)
    for pct, prompt, output in AZURE_CONV:
        # 0.03: P95 sits where the prompt density is thin (P90 2,735 to P95 4,083)
        assert _within(float(np.percentile(prompts, pct)), prompt, 0.03), (pct, np.percentile(prompts, pct))
        assert _within(float(np.percentile(outputs, pct)), output, 0.02), (pct, np.percentile(outputs, pct))
    assert _within(float(outputs.mean()), 211.1, 0.02)  # the trace's mean: long outputs
    assert _within(float(prompts.mean()), 1154.7, 0.03)
    assert prompts.min() >= 2 and prompts.max() <= 14_050 and outputs.min() >= 7 and outputs.max() <= 1000
    assert _within(_realised_rps(arrivals), 5.5, 0.05)
    gaps = np.diff(arrivals)
    assert _within(float(gaps.std() / gaps.mean()), 1.09, 0.10)
    assert WORKLOADS["azure_conv"].prompt.median == pytest.approx(1020)
    assert WORKLOADS["azure_conv"].completion.median == pytest.approx(129)


def test_quantiles_hit_their_knots_and_reject_bad_tables() -> None:
    q = Quantiles(((0, 10), (50, 100), (100, 1000)))
    assert q.median == pytest.approx(100)
    draws = q.sample(np.random.default_rng(0), 20_000)
    assert draws.min() >= 10 and draws.max() <= 1000
    assert _within(float(np.median(draws)), 100, 0.03)
    with pytest.raises(ValueError, match=r"from percent 0 to 100, got \[0, 50\]"):
        Quantiles(((0, 10), (50, 100)))
    with pytest.raises(ValueError, match="strictly increasing"):
        Quantiles(((0, 10), (50, 100), (50, 200), (100, 1000)))
    with pytest.raises(ValueError, match="non-decreasing"):
        Quantiles(((0, 10), (50, 5), (100, 1000)))
    with pytest.raises(ValueError, match=">= 1"):
        Quantiles(((0, 0), (100, 1000)))


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_shape_ids_and_order(name: str) -> None:
    requests = make_workload(name, rps=5.0, num_requests=300, seed=3)
    assert len(requests) == 300
    assert [r.request_id for r in requests] == [f"{name}-{i:06d}" for i in range(300)]
    arrivals = [r.arrival_s for r in requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert all(isinstance(r.prompt_tokens, int) and isinstance(r.output_tokens, int) for r in requests)


def test_same_seed_identical_different_seed_differs() -> None:
    a = make_workload("bursty", rps=None, num_requests=500, seed=11)
    b = make_workload("bursty", rps=None, num_requests=500, seed=11)
    c = make_workload("bursty", rps=None, num_requests=500, seed=12)
    assert a == b
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in c]
    assert [r.output_tokens for r in a] != [r.output_tokens for r in c]


def test_workloads_with_same_seed_and_rate_do_not_share_arrivals() -> None:
    hpld = make_workload("hpld", rps=None, num_requests=100, seed=0)
    hphd = make_workload("hphd", rps=None, num_requests=100, seed=0)
    assert [r.arrival_s for r in hpld][1:] != [r.arrival_s for r in hphd][1:]


def test_duration_run_is_prefix_of_count_run() -> None:
    by_time = make_workload("bursty", rps=8.0, duration_s=300.0, seed=5)
    assert by_time[-1].arrival_s < 300.0
    by_count = make_workload("bursty", rps=8.0, num_requests=len(by_time) + 20, seed=5)
    assert by_count[: len(by_time)] == by_time
    assert by_count[len(by_time)].arrival_s >= 300.0


def test_rps_override_and_name_case() -> None:
    arrivals, _, _ = _columns(make_workload("LPLD", rps=3.0, num_requests=20_000, seed=2))
    assert _within(_realised_rps(arrivals), 3.0, 0.05)


def test_max_context_clips_prompt_to_fit() -> None:
    requests = make_workload("hphd", rps=None, num_requests=2_000, seed=0, max_context=12_000)
    _, prompts, outputs = _columns(requests)
    assert (prompts + outputs).max() == 12_000  # HP prompts all exceed the budget, so they get clipped
    assert outputs.min() > COMPLETION_P90  # completions are never clipped below the context


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'nope'.*bursty, lpld, lphd, hpld, hphd, azure_conv"):
        make_workload("nope", rps=None, num_requests=10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rps": 0.0, "num_requests": 10}, "rps must be a finite number > 0, got 0.0"),
        ({"rps": -2.0, "num_requests": 10}, "rps must be a finite number > 0, got -2.0"),
        ({"rps": math.nan, "num_requests": 10}, "rps must be a finite number > 0, got nan"),
        ({"cv": 0.0, "num_requests": 10}, "cv must be a finite number > 0, got 0.0"),
        ({"cv": -1.0, "num_requests": 10}, "cv must be a finite number > 0, got -1.0"),
        ({}, "exactly one of duration_s and num_requests, got duration_s=None, num_requests=None"),
        ({"duration_s": 5.0, "num_requests": 10}, "exactly one of duration_s and num_requests, got duration_s=5.0"),
        ({"duration_s": -1.0}, "duration_s must be a finite number > 0, got -1.0"),
        ({"duration_s": math.inf}, "duration_s must be a finite number > 0, got inf"),
        ({"num_requests": 0}, "num_requests must be an int >= 1, got 0"),
        ({"num_requests": 2.5}, "num_requests must be an int >= 1, got 2.5"),
        ({"num_requests": 10, "seed": -1}, "seed must be an int >= 0, got -1"),
        ({"num_requests": 10, "max_context": 1}, "max_context must be an int >= 2, got 1"),
    ],
)
def test_bad_parameters_raise_with_value(kwargs: dict[str, float], message: str) -> None:
    kwargs = {"rps": None, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        make_workload("bursty", **kwargs)


def test_lognormal_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match=r"sigma must be finite and > 0, got 0\.0"):
        LogNormal(mu=1.0, sigma=0.0)
    with pytest.raises(ValueError, match=r"median must lie inside \(0\.5, 20\.5\), got 30"):
        LogNormal.with_median(30, 0.3, lo=0.5, hi=20.5)
    with pytest.raises(ValueError, match="keeps only"):
        LogNormal(mu=0.0, sigma=0.3, lo=1000.5)
