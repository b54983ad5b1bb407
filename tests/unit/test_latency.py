"""Step-latency models: formulas on hand-computed points, knees, the packaged profile's
calibration against the paper's published figures, round trips and malformed profiles."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.common.errors import ProfileError
from kairos.core.latency import DEFAULT_PROFILE, LatencyModels, load_profile
from tests.builders import make_models, models_dict

# ---------------------------------------------------------------------------------------------
# Formulas (builder defaults: prefill 0.010 + 1e-4 n; T0 = 0.040 + 0.001 B; increment 1e-4 p + 1e-7 p c)
# ---------------------------------------------------------------------------------------------
PREFILL_CASES = [
    # (id, overrides, tokens, cached, expected seconds)
    pytest.param({}, 0, 0, 0.010, id="empty-step-is-the-intercept"),
    pytest.param({}, 512, 0, 0.0612, id="512-tokens: 0.010+512e-4"),
    pytest.param({}, 512, 4096, 0.0612, id="cached-ignored-when-its-coefficient-is-0"),
    # 0.010 + 100e-4 + 1e-8*100*1000 = 0.010 + 0.010 + 0.001
    pytest.param({"prefill_x_cached": 1e-8}, 100, 1000, 0.021, id="tokens-x-cached-term"),
    # knee at 1000, 1e-4 per token over it
    pytest.param({"prefill_knee": 1000, "prefill_over_knee": 1e-4}, 800, 0, 0.090, id="below-knee: 0.010+0.080"),
    pytest.param({"prefill_knee": 1000, "prefill_over_knee": 1e-4}, 1000, 0, 0.110, id="at-knee-no-extra"),
    # 0.010 + 0.150 + 1e-4*(1500-1000)
    pytest.param({"prefill_knee": 1000, "prefill_over_knee": 1e-4}, 1500, 0, 0.210, id="over-knee: +1e-4*500"),
]


@pytest.mark.parametrize(("overrides", "tokens", "cached", "expected"), PREFILL_CASES)
def test_prefill_step_formula(overrides: dict[str, float], tokens: int, cached: int, expected: float) -> None:
    assert make_models(**overrides).prefill_step_s(tokens, cached) == pytest.approx(expected)


DECODE_CASES = [
    pytest.param({}, 0, 0, 0.040, id="idle-node-is-the-intercept"),
    pytest.param({}, 20, 0, 0.060, id="B20: 0.040+0.020"),
    pytest.param({}, 32, 100_000, 0.072, id="K-ignored-when-its-coefficient-is-0"),
    # 0.040 + 0.016 + 1e-7*50000
    pytest.param({"decode_per_k": 1e-7}, 16, 50_000, 0.061, id="B16-K50000: +0.005-for-KV"),
]


@pytest.mark.parametrize(("overrides", "b", "k", "expected"), DECODE_CASES)
def test_decode_step_formula(overrides: dict[str, float], b: int, k: int, expected: float) -> None:
    assert make_models(**overrides).decode_step_s(b, k) == pytest.approx(expected)


ALL_MIXED = {
    "mixed_b0": 0.001,
    "mixed_per_p": 1e-4,
    "mixed_p_x_b": 1e-6,
    "mixed_p_x_k": 1e-9,
    "mixed_p_x_cached": 1e-7,
    "mixed_over_knee": 1e-5,
    "mixed_knee": 100,
}
MIXED_CASES = [
    # (overrides, step tokens, cached, B, K, expected increment)
    pytest.param({}, 120, 0, 20, 0, 0.010, id="first-chunk-p100: 100*1e-4"),
    pytest.param({}, 120, 1000, 20, 0, 0.020, id="later-chunk-p100-c1000: 100*(1e-4+1e-7*1000)"),
    pytest.param({}, 20, 1000, 20, 0, 0.0, id="step-of-only-decodes-adds-nothing"),
    pytest.param({}, 10, 0, 20, 0, 0.0, id="step-smaller-than-B-adds-nothing"),
    # p = 200: 0.001 + 200*(1e-4 + 1e-6*100 + 1e-9*100000 + 1e-7*500) + 1e-5*(300-100)
    #        = 0.001 + 200*3.5e-4 + 0.002 = 0.073
    pytest.param(ALL_MIXED, 300, 500, 100, 100_000, 0.073, id="every-feature-in-contract-order"),
    # p = 0: neither the intercept nor the knee term applies, though 150 > knee 100
    pytest.param(ALL_MIXED, 150, 0, 150, 0, 0.0, id="no-prefill-no-intercept-no-knee"),
]


@pytest.mark.parametrize(("overrides", "step", "cached", "b", "k", "expected"), MIXED_CASES)
def test_mixed_increment_formula(
    overrides: dict[str, float], step: int, cached: int, b: int, k: int, expected: float
) -> None:
    assert make_models(**overrides).mixed_increment_s(step, cached, b, k) == pytest.approx(expected)


def test_mixed_step_is_decode_step_plus_increment() -> None:
    # Eq. 4: T0(20, 0) = 0.060, increment 100*(1e-4 + 1e-7*1000) = 0.020
    assert make_models().mixed_step_s(120, 1000, 20, 0) == pytest.approx(0.080)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        pytest.param(0, 0.001, id="latency-only"),
        pytest.param(500, 0.501, id="500-tokens: 0.001+500*1000/1e6"),
    ],
)
def test_kv_transfer_formula(tokens: int, expected: float) -> None:
    assert make_models().kv_transfer_s(tokens) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param({}, True, id="default-later-chunks-cost-more"),
        pytest.param({"mixed_p_x_cached": -1e-7}, False, id="negative-cached-term-not-monotone"),
        pytest.param({"decode_per_k": -1e-9}, False, id="negative-kv-term-not-monotone"),
        pytest.param({"mixed_p_x_k": 2e-7, "mixed_p_x_cached": -1e-7}, True, id="kv-term-outweighs-cached-term"),
    ],
)
def test_mixed_monotone(overrides: dict[str, float], expected: bool) -> None:
    assert make_models(**overrides).mixed_monotone is expected


# ---------------------------------------------------------------------------------------------
# The packaged profile against the figures its provenance claims
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packaged() -> LatencyModels:
    return load_profile()


def test_packaged_profile_loads_by_default_name(packaged: LatencyModels) -> None:
    assert packaged.name == DEFAULT_PROFILE == "deepseek-v2-lite-a100"
    assert packaged.provenance["kind"] == "calibrated"
    assert packaged.provenance["measured"] is False
    assert load_profile(DEFAULT_PROFILE) == packaged


@pytest.mark.parametrize(
    ("b", "expected"),
    [
        # 0.046 + 1.5e-4*16 + 1.55e-8*(16*3569=57104) = 0.046 + 0.0024 + 0.000885112
        pytest.param(16, 0.049285112, id="B16-bursty"),
        # 0.046 + 0.0036 + 1.55e-8*85656 (0.001327668)
        pytest.param(24, 0.050927668, id="B24-bursty"),
        # 0.046 + 0.0048 + 1.55e-8*114208 (0.001770224)
        pytest.param(32, 0.052570224, id="B32-bursty"),
    ],
)
def test_packaged_decode_step_is_49_to_53_ms_at_bursty_context(
    packaged: LatencyModels, b: int, expected: float
) -> None:
    t0 = packaged.decode_step_s(b, b * 3569)
    assert t0 == pytest.approx(expected)
    assert 0.049 <= t0 <= 0.053


@pytest.mark.parametrize("context", [842, 998, 3569, 14013])
@pytest.mark.parametrize("b", [4, 8, 16, 32])
def test_packaged_chunk_of_at_most_512_adds_at_most_30_ms(packaged: LatencyModels, b: int, context: int) -> None:
    for prefill in (128 - b, 256 - b, 512 - b, 128, 256, 512):
        added = packaged.mixed_increment_s(b + prefill, 0, b, b * context)
        assert 0.0 < added <= 0.030, (b, context, prefill, added)


def test_packaged_worst_512_chunk_by_hand(packaged: LatencyModels) -> None:
    # B=32, K=32*14013=448416, p=512: 0.002 + 512*(1.7e-5 + 6e-7*32 + 4e-11*448416)
    #   = 0.002 + 512*5.413664e-5 = 0.002 + 0.02771796 = 0.02971796
    assert packaged.mixed_increment_s(544, 0, 32, 448_416) == pytest.approx(0.02971796)


@pytest.mark.parametrize(
    ("b", "context", "low", "high", "expected"),
    [
        # p=1020: 0.002 + 1020*(1.7e-5 + 2.4e-6 + 4e-11*3368) = 0.002 + 1020*1.9534720e-5
        pytest.param(4, 842, 0.020, 0.030, 0.0219254144, id="B4-short-context: 20-30ms"),
        # p=992: 0.002 + 992*(1.7e-5 + 1.92e-5 + 4e-11*114208) = 0.002 + 992*4.0768320e-5
        pytest.param(32, 3569, 0.040, 0.055, 0.04244217344, id="B32-bursty: 40-55ms"),
    ],
)
def test_packaged_first_1024_chunk(
    packaged: LatencyModels, b: int, context: int, low: float, high: float, expected: float
) -> None:
    added = packaged.mixed_increment_s(1024, 0, b, b * context)
    assert added == pytest.approx(expected)
    assert low <= added <= high


def test_packaged_fifth_2048_chunk_adds_about_250_ms(packaged: LatencyModels) -> None:
    # B=32, K=32*3569=114208, p=2048-32=2016, fifth chunk: c=4*2016=8064, node KV = K + c = 122272
    # 0.002 + 2016*(1.7e-5 + 1.92e-5 + 4e-11*122272 + 9e-9*8064) + 3e-5*(2048-1600)
    #   = 0.002 + 2016*1.1366688e-4 + 0.01344 = 0.002 + 0.22915243 + 0.01344 = 0.24459243
    added = packaged.mixed_increment_s(2048, 8064, 32, 122_272)
    assert added == pytest.approx(0.24459243)
    assert 0.230 <= added <= 0.260


@pytest.mark.parametrize("chi", [512, 1024, 2048])
def test_packaged_later_chunks_cost_more(packaged: LatencyModels, chi: int) -> None:
    b, k = 32, 32 * 3569
    p = chi - b
    added = [packaged.mixed_increment_s(chi, i * p, b, k + i * p) for i in range(5)]
    assert all(a < z for a, z in itertools.pairwise(added)), added
    assert packaged.mixed_monotone


def test_packaged_kv_bytes_per_token_is_deepseek_v2_lite_mla(packaged: LatencyModels) -> None:
    # 27 layers x (512 + 64) x 2 bytes
    assert packaged.transfer.bytes_per_token == 27 * (512 + 64) * 2 == 31_104


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------
def test_to_dict_from_dict_round_trip() -> None:
    m = make_models(prefill_x_cached=1e-8, decode_per_k=1e-7, mixed_b0=0.002)
    again = LatencyModels.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m
    assert again.decode.mape == 0.05 and again.decode.samples == 120
    assert again.mixed_step_s(120, 1000, 20, 0) == m.mixed_step_s(120, 1000, 20, 0)


def test_packaged_round_trip_through_a_file(packaged: LatencyModels, tmp_path: Path) -> None:
    path = tmp_path / "copy.json"
    path.write_text(json.dumps(packaged.to_dict()))
    assert load_profile(path) == packaged
    assert load_profile(str(path)) == packaged


# ---------------------------------------------------------------------------------------------
# Malformed profiles
# ---------------------------------------------------------------------------------------------
def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return edit


def _drop(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]

    return edit


MALFORMED = [
    pytest.param(_set(("schema_version",), 2), "schema_version 2 is not supported (expected 1)", id="schema-version-2"),
    # A string "1" must not read "schema_version 1 is not supported (expected 1)".
    pytest.param(_set(("schema_version",), "1"), "schema_version '1'", id="schema-version-as-string"),
    pytest.param(_drop(("schema_version",)), "schema_version", id="schema-version-missing"),
    pytest.param(_drop(("hardware",)), "missing keys ['hardware']", id="top-level-key-missing"),
    pytest.param(_drop(("models", c.DECODE_STEP)), c.DECODE_STEP, id="decode-model-missing"),
    pytest.param(_drop(("models", c.KV_TRANSFER)), c.KV_TRANSFER, id="transfer-model-missing"),
    pytest.param(
        _set(("models", c.DECODE_STEP, "features"), ["kv_tokens", "decode_tokens"]),
        "features ['kv_tokens', 'decode_tokens'] != ['decode_tokens', 'kv_tokens']",
        id="features-out-of-order",
    ),
    pytest.param(
        _set(("models", c.PREFILL_STEP, "features"), ["tokens", "tokens_x_cached"]),
        "model 'prefill_step': features",
        id="feature-missing",
    ),
    pytest.param(
        _set(("models", c.PREFILL_STEP, "coefficients"), [1e-4, 0.0]),
        "2 coefficients for 3 features",
        id="coefficient-missing",
    ),
    pytest.param(_drop(("models", c.MIXED_INCREMENT, "knee_tokens")), "knee_tokens must be > 0", id="knee-missing"),
    pytest.param(
        _set(("models", c.DECODE_STEP, "coefficients"), ["fast", 0.0]),
        "malformed profile (ValueError",
        id="coefficient-not-a-number",
    ),
    pytest.param(_set(("models", c.KV_TRANSFER, "bandwidth_bytes_per_s"), 0), "must be > 0", id="zero-link-bandwidth"),
]


@pytest.mark.parametrize(("edit", "message"), MALFORMED)
def test_malformed_profile_raises_profile_error(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    data = copy.deepcopy(models_dict())
    edit(data)
    with pytest.raises(ProfileError) as info:
        LatencyModels.from_dict(data, source="bad.json")
    assert message in info.value.message
    assert info.value.code == "invalid_profile"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="bad-json"),
        pytest.param("[1, 2]", "a profile is a JSON object, got list", id="json-list"),
        pytest.param('{"schema_version": 9}', "schema_version 9 is not supported", id="json-wrong-version"),
    ],
)
def test_bad_profile_file_raises_profile_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert message in info.value.message
    assert str(path) in info.value.message


def test_missing_profile_file_raises_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "absent.json")


def test_unknown_packaged_profile_lists_the_known_ones() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("llama-on-a-toaster")
    assert "unknown profile 'llama-on-a-toaster'" in info.value.message
    assert "deepseek-v2-lite-a100" in info.value.message
