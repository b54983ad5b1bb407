"""``kairos replay`` with per-request SLOs, without servers: a mixed-class workload's requests
carry their class's SLOs, each is sent with them as x-slo-ttft-ms / x-slo-tpot-ms, judged by its
own, and the report gives attainment and goodput per class (the simulator's definition)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kairos.common import contracts as c
from kairos.common.errors import ConfigError
from kairos.core.slo import DEFAULT_CLASSES, request_slo
from kairos.launcher.replay import (
    ReplayConfig,
    RequestResult,
    format_summary,
    requests_for,
    slo_headers,
    summarize,
)
from kairos.sim.metrics import per_class_figures
from kairos.traffic.workloads import SLO_CLASS_MIXES, make_class_mix


def test_the_class_mix_workload_is_the_simulators_with_every_request_carrying_its_classes_slos() -> None:
    config = ReplayConfig(workload="interactive_batch", rps=4.0, duration_s=60.0, seed=2)
    reqs = requests_for(config)
    assert reqs == make_class_mix("interactive_batch", rps=4.0, duration_s=60.0, seed=2)
    shares = {k.name: k for k in SLO_CLASS_MIXES["interactive_batch"]}
    for r in reqs:
        k = shares[r.request_id.split("-")[0]]
        assert (r.ttft_slo_s, r.tpot_slo_s) == (k.ttft_s, k.tpot_s)
    assert {r.request_id.split("-")[0] for r in reqs} == set(shares)


def test_the_class_mix_sized_by_count_keeps_its_first_arrivals() -> None:
    reqs = requests_for(ReplayConfig(workload="interactive_batch", rps=2.0, num_requests=300, seed=1))
    assert len(reqs) == 300
    longer = make_class_mix("interactive_batch", rps=2.0, duration_s=1000.0, seed=1)
    # A longer run of the same streams begins with the same arrivals.
    assert [r.request_id for r in reqs] == [r.request_id for r in longer[:300]]


@pytest.mark.parametrize(("overrides", "match"), [({}, "needs --rps"), ({"rps": 2.0, "cv": 2.0}, "takes no --cv")])
def test_the_class_mix_refuses_what_it_cannot_honour(overrides: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        requests_for(ReplayConfig(workload="interactive_batch", **overrides))


def test_slo_headers_are_milliseconds_the_gateway_reads_back_exactly() -> None:
    headers = slo_headers(1.0, 0.06)
    assert headers == {c.H_SLO_TTFT_MS: "1000", c.H_SLO_TPOT_MS: "60"}
    slo = request_slo(headers[c.H_SLO_TTFT_MS], headers[c.H_SLO_TPOT_MS])
    assert (slo.ttft_s, slo.tpot_s) == (1.0, 0.06)
    assert slo_headers(0.0125, None) == {c.H_SLO_TTFT_MS: "12.5"}
    assert slo_headers(None, None) == {}


def _served(
    rid: str, arrival: float, ttft: float, gaps_ms: list[float], slos: tuple[float, float] | None, out: int = 10
) -> RequestResult:
    r = RequestResult(rid, arrival, 100, out, status=200, route="keep", ttft_s=ttft, tbt_ms=gaps_ms)
    r.e2e_s = ttft + sum(gaps_ms) / 1e3
    r.usage = {"prompt_tokens": 100, "completion_tokens": out}
    if slos is not None:
        r.ttft_slo_s, r.tpot_slo_s = slos
    return r


INTERACTIVE, BATCH = (1.0, 0.060), (20.0, 0.150)


def test_each_request_is_judged_by_its_own_slos_and_counted_in_its_class() -> None:
    config = ReplayConfig()  # the replay's SLO: TTFT 4 s, TBT 70 ms
    results = [
        _served("i0", 0.0, 0.5, [50.0] * 9, INTERACTIVE),  # met
        _served("i1", 1.0, 2.0, [50.0] * 9, INTERACTIVE),  # TTFT 2 s > its 1 s (the replay's 4 s would pass it)
        _served("i2", 2.0, 0.5, [65.0] * 9, INTERACTIVE),  # TBT 65 ms > its 60 ms (< the replay's 70)
        _served("b0", 0.0, 10.0, [120.0] * 9, BATCH, out=20),  # met: 10 s and 120 ms within 20 s / 150 ms
        _served("b1", 3.0, 25.0, [10.0] * 9, BATCH, out=30),  # TTFT 25 s > 20 s
        RequestResult("b2", 4.0, 100, 40, status=503, error="HTTP 503: shed", ttft_slo_s=20.0, tpot_slo_s=0.15),
    ]
    results[1].route = "deflect"
    summary = summarize(results, config)
    assert summary["slo_attainment"] == pytest.approx(2 / 6)
    per_class = summary["per_class"]
    assert list(per_class) == ["interactive", "batch"]
    span = summary["span_s"]
    inter, batch = per_class["interactive"], per_class["batch"]
    assert inter["requests"] == 3 and inter["errors"] == 0 and inter["deflections"] == 1
    assert inter["slo_attainment"] == pytest.approx(1 / 3)
    assert inter["goodput_rps"] == pytest.approx(1 / span)
    assert inter["goodput_tokens_per_s"] == pytest.approx(10 / span)
    assert (inter["class_ttft_slo_s"], inter["class_tpot_slo_ms"]) == (1.0, 60.0)
    assert batch["requests"] == 3 and batch["errors"] == 1 and batch["slo_attainment"] == pytest.approx(1 / 3)
    assert batch["goodput_tokens_per_s"] == pytest.approx(20 / span)
    assert batch["p95_ttft_s"] == pytest.approx(float(np.percentile([10.0, 25.0], 95)))  # the failed one has none
    table = format_summary(summary)
    assert "a request's own SLOs where it sends them" in table
    line = next(x for x in table.splitlines() if x.startswith("interactive"))
    assert "1/60" in line and "33.3%" in line


def test_the_figures_are_the_simulators_definition() -> None:
    results = [
        _served("i0", 0.0, 0.5, [50.0] * 9, INTERACTIVE),
        _served("b0", 1.0, 30.0, [50.0] * 9, BATCH, out=7),
        _served("b1", 2.0, 1.0, [50.0] * 9, BATCH, out=9),
    ]
    summary = summarize(results, ReplayConfig())
    expected = per_class_figures(
        np.array(["interactive", "batch", "batch"]),
        np.array([True, False, True]),
        np.array([10, 7, 9]),
        np.array([False, False, False]),
        np.array([0.5, 30.0, 1.0]),
        summary["span_s"],
        DEFAULT_CLASSES,
    )
    for name, figures in expected.items():
        assert {k: summary["per_class"][name][k] for k in figures} == figures


def test_requests_without_slos_of_their_own_have_no_per_class_figures() -> None:
    results = [_served("r0", 0.0, 0.5, [50.0] * 9, None), _served("r1", 1.0, 5.0, [50.0] * 9, None)]
    summary = summarize(results, ReplayConfig())
    assert "per_class" not in summary and summary["slo_attainment"] == 0.5
    assert "own SLOs" not in format_summary(summary)


def test_a_request_with_one_slo_of_its_own_takes_the_replays_other() -> None:
    config = ReplayConfig(ttft_slo_s=4.0, tbt_slo_ms=70.0)
    only_ttft = dataclasses.replace(_served("r0", 0.0, 0.5, [65.0] * 9, None), ttft_slo_s=1.0)
    summary = summarize([only_ttft], config)
    # 1 s / 70 ms: looser TPOT than interactive's 60 ms, within the standard class's 4 s / 70 ms.
    assert list(summary["per_class"]) == ["standard"] and summary["per_class"]["standard"]["slo_attainment"] == 1.0
