"""The replay's figures in the field's terms: vLLM's and inference-perf's definitions, by hand."""

from __future__ import annotations

import pytest

from kairos.common.errors import ConfigError
from kairos.launcher.replay import RequestResult
from kairos.launcher.replay_plots import in_flight_steps
from kairos.launcher.serving_metrics import Goodput, duration_s, field_metrics, latencies


def _done(arrival: float, ttft: float, e2e: float, gaps_ms: list[float], n: int, prompt: int = 100) -> RequestResult:
    r = RequestResult("r", arrival, prompt, n, status=200, ttft_s=ttft, e2e_s=e2e, tbt_ms=gaps_ms, tokens=n)
    r.usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    return r


def _failed(arrival: float) -> RequestResult:
    return RequestResult("f", arrival, 100, 4, status=503, error="HTTP 503: no decode node")


def test_tpot_differs_by_tool_exactly_where_their_definitions_do() -> None:
    # 4 tokens: first at 0.5 s, gaps 100/100/100 ms, so the last token at 0.8 s; the stream ends
    # at 1.0 s (the usage chunk and [DONE] come 200 ms after the last token).
    lat = latencies(_done(0.0, 0.5, 1.0, [100.0, 100.0, 100.0], 4))
    assert lat is not None
    assert lat.vllm_tpot_s == pytest.approx((1.0 - 0.5) / 3)  # to the stream's end
    assert lat.inference_perf_tpot_s == pytest.approx((0.8 - 0.5) / 3)  # to the last token
    assert lat.ntpot_s == pytest.approx(1.0 / 4)


def test_one_token_requests_have_tpot_zero_for_goodput_and_none_in_the_percentiles() -> None:
    one = _done(0.0, 0.2, 0.3, [], 1)
    lat = latencies(one)
    assert lat is not None and lat.vllm_tpot_s == 0.0 and lat.inference_perf_tpot_s is None
    doc = field_metrics([one], Goodput.parse(["ttft:250", "tpot:1"]), duration=1.0)
    assert doc["vllm"]["tpot_ms"]["median"] is None  # vLLM leaves n <= 1 out of TPOT
    assert doc["vllm"]["request_goodput"] == 1.0  # ... but counts it good with tpot 0


def test_failed_requests_are_counted_and_left_out_of_every_latency() -> None:
    results = [_done(0.0, 0.5, 1.0, [250.0, 250.0], 3, prompt=10), _failed(0.5)]
    doc = field_metrics(results, Goodput(), duration=2.0)
    v, ip = doc["vllm"], doc["inference_perf"]
    assert (v["completed"], v["failed"], v["total_input_tokens"], v["total_output_tokens"]) == (1, 1, 10, 3)
    assert v["ttft_ms"]["mean"] == pytest.approx(500.0) and v["e2el_ms"]["p99"] == pytest.approx(1000.0)
    assert v["request_throughput"] == pytest.approx(0.5) and v["output_throughput"] == pytest.approx(1.5)
    assert v["total_token_throughput"] == pytest.approx(6.5)
    assert v["request_goodput"] is None and v["goodput"] == []  # no --goodput given
    assert (ip["count"], ip["failures"]) == (1, 1)
    assert ip["time_per_output_token_ms"]["mean"] == pytest.approx(250.0)


def test_itl_pools_every_gap_of_every_request() -> None:
    results = [_done(0.0, 0.1, 0.5, [10.0, 30.0], 3), _done(1.0, 0.1, 0.5, [20.0], 2)]
    doc = field_metrics(results, Goodput(), duration=1.5)
    assert doc["vllm"]["itl_ms"]["mean"] == pytest.approx(20.0)
    assert doc["vllm"]["itl_ms"]["median"] == pytest.approx(20.0)
    assert doc["inference_perf"]["inter_token_latency_ms"]["p50"] == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("limits", "good"),
    [
        (["ttft:500"], 2),  # ttft 0.5 and 0.4: both within (<=, as vLLM compares)
        (["ttft:450"], 1),
        (["tpot:200"], 2),  # tpots 200 and 150 ms
        (["tpot:199"], 1),
        (["e2el:900"], 1),
        (["ttft:500", "tpot:199", "e2el:2000"], 1),
    ],
)
def test_goodput_counts_requests_within_every_limit(limits: list[str], good: int) -> None:
    results = [
        _done(0.0, 0.5, 0.9, [100.0, 100.0], 3),  # vLLM tpot (0.9 - 0.5) / 2 = 200 ms
        _done(0.0, 0.4, 1.0, [100.0] * 4, 5),  # (1.0 - 0.4) / 4 = 150 ms
    ]
    doc = field_metrics(results, Goodput.parse(limits), duration=2.0)
    assert doc["vllm"]["request_goodput"] == pytest.approx(good / 2.0)


@pytest.mark.parametrize("item", ["ttft", "ttft:", "ttft:abc", "tbt:70", "ttft:-1", "ttft:inf", "e2e:5"])
def test_goodput_refuses_what_vllm_would_refuse(item: str) -> None:
    with pytest.raises(ConfigError):
        Goodput.parse([item])


def test_goodput_round_trips_to_vllm_arguments() -> None:
    assert Goodput.parse(["tpot:70", "ttft:4000"]).to_cli() == ["ttft:4000", "tpot:70"]
    assert not Goodput() and Goodput.parse(["e2el:1"])


def test_duration_runs_from_the_first_arrival_to_the_last_end() -> None:
    assert duration_s([_done(1.0, 0.1, 2.0, [], 1), _done(2.5, 0.1, 0.2, [], 1), _failed(4.0)]) == pytest.approx(3.0)
    assert duration_s([]) == 0.0


def test_in_flight_steps_count_overlaps_and_end_before_start_at_a_tie() -> None:
    times, counts = in_flight_steps([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)])
    assert list(zip(times.tolist(), counts.tolist(), strict=True)) == [
        (0.0, 1),
        (1.0, 2),
        (2.0, 1),  # the first ends at 2.0 ...
        (2.0, 2),  # ... before the third starts there
        (3.0, 1),
        (4.0, 0),
    ]
