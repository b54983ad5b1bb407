"""The decode nodes' step calibration (kairos.core.calibration): a bounded, decaying upper
quantile of actual / predicted step time, fed by hand-made step pairs, with no server or clock."""

from __future__ import annotations

import math

import pytest

from kairos.common.contracts import STEP_CALIBRATION_MAX, STEP_CALIBRATION_MIN, Role
from kairos.common.errors import ConfigError
from kairos.core.calibration import BINS_PER_OCTAVE, StepCalibration, predicted_step_s, prior_from_mape
from kairos.core.latency import load_profile
from kairos.sim.engine import Chunk, Sequence, StepPlan, model_step_time

BIN = 2 ** (1 / BINS_PER_OCTAVE)  # one bin's width, as a ratio


def feed(cal: StepCalibration, ratios: list[float], predicted: float = 0.05) -> StepCalibration:
    for r in ratios:
        cal.observe(predicted, predicted * r)
    return cal


def test_it_reports_no_less_than_its_prior_until_it_has_enough_steps() -> None:
    cal = StepCalibration(min_samples=10, prior=1.2)
    assert cal.value == 1.2
    feed(cal, [1.0] * 9)
    assert cal.value == 1.2  # not yet trusted to be faster than the prior
    feed(cal, [1.0])
    assert cal.value == 1.0
    # But at once slower, with the normal tail of the few steps in: 1.25 + 2.326 x 0.3536.
    slow = feed(StepCalibration(min_samples=10, prior=1.2), [1.0, 1.5])
    assert slow.value == pytest.approx(1.25 + 2.3263479 * math.sqrt(0.125))
    one = feed(StepCalibration(min_samples=10), [1.3])  # one step: no spread yet, its own bin
    assert 1.3 <= one.value < 1.3 * BIN
    assert StepCalibration().value == 1.0  # no prior known: trust the model


def test_an_exact_model_calibrates_to_one_exactly() -> None:
    """Ratios of exactly 1 (and 1 +- rounding, as end - start gives) land in the bin whose upper
    edge is 1.0: a node whose truth is its model plans exactly as the paper's Eq. 5."""
    cal = feed(StepCalibration(min_samples=1), [1.0, 1.0 + 1e-15, 1.0 - 1e-15] * 100)
    assert cal.value == 1.0


def test_the_estimate_is_the_upper_quantile_rounded_up_to_a_bin_edge() -> None:
    # 1000 ratios evenly spread over [1, 2): the 99th percentile is 1.99.
    ratios = [1.0 + i / 1000 for i in range(1000)]
    cal = feed(StepCalibration(quantile=0.99, half_life_steps=1e9, min_samples=1), ratios)
    assert 1.99 <= cal.value < 1.99 * BIN
    median = feed(StepCalibration(quantile=0.5, half_life_steps=1e9, min_samples=1), ratios)
    assert 1.5 <= median.value < 1.5 * BIN * BIN


def test_recent_steps_weigh_more_so_it_follows_a_change() -> None:
    cal = feed(StepCalibration(half_life_steps=100, min_samples=1), [1.0] * 5000)
    assert cal.value == 1.0
    feed(cal, [1.4] * 50)  # half a half-life: the new steps hold 29% of the weight, above 1%
    assert 1.4 <= cal.value < 1.4 * BIN
    feed(cal, [0.8] * 2000)  # twenty half-lives: the 1.4 steps weigh 1e-6 of the total
    assert 0.8 <= cal.value < 0.8 * BIN


def test_a_faster_node_may_calibrate_under_one_and_values_saturate_at_the_contracts_range() -> None:
    assert 0.9 <= feed(StepCalibration(min_samples=1), [0.9] * 100).value < 0.9 * BIN
    assert feed(StepCalibration(min_samples=1), [50.0] * 10).value == STEP_CALIBRATION_MAX
    assert feed(StepCalibration(min_samples=1), [0.01] * 10).value == STEP_CALIBRATION_MIN


def test_invalid_steps_are_skipped() -> None:
    cal = StepCalibration(min_samples=1)
    for predicted, actual in [(0.0, 0.05), (0.05, 0.0), (-1.0, 0.05), (math.nan, 0.05), (0.05, math.inf)]:
        cal.observe(predicted, actual)
    assert cal.count == 0 and cal.value == 1.0


def test_memory_is_bounded_and_weights_never_overflow() -> None:
    cal = StepCalibration(half_life_steps=1, min_samples=1)  # each step doubles the weight
    size = len(cal._weights)
    feed(cal, [1.1, 1.2, 1.3] * 2000)  # 2^6000 without the rescale
    assert len(cal._weights) == size and all(math.isfinite(w) for w in cal._weights)
    assert 1.3 <= cal.value < 1.3 * BIN


@pytest.mark.parametrize(
    "kwargs",
    [{"quantile": 1.0}, {"quantile": 0.2}, {"half_life_steps": 0.5}, {"min_samples": 0}, {"prior": 10.0}],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        StepCalibration(**kwargs)  # type: ignore[arg-type]


def test_the_prior_from_a_profiles_error_is_that_errors_upper_quantile() -> None:
    assert prior_from_mape(None) == prior_from_mape(0.0) == 1.0
    # 1 + z(0.99) x sqrt(pi/2) x 0.1 = 1 + 2.326348 x 1.253314 x 0.1
    assert prior_from_mape(0.1) == pytest.approx(1.2915645, abs=1e-7)


def test_the_prediction_is_the_engines_clean_step_time() -> None:
    models = load_profile()
    seq = Sequence("r", 3000, 10)
    plan = StepPlan(0, 0.0, 12, 40_000, (Chunk(seq, 512, 1024), Chunk(seq, 256, 0)), 0, 768)
    for role in Role:
        got = predicted_step_s(models, role, plan.decode_tokens, plan.kv_tokens, plan.chunks)
        assert got == model_step_time(models)(role, plan)
    assert predicted_step_s(models, Role.DECODE, 12, 40_000, ()) == models.decode_step_s(12, 40_000)
