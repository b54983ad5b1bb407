"""bench/e2e_replay.py's request-by-request comparison of a replay with the simulator."""

from __future__ import annotations

import pytest

from bench.e2e_replay import SimOutcome, fidelity, format_fidelity
from kairos.replay import RequestResult


def served(request_id: str, route: str, node: str, ttft_s: float) -> RequestResult:
    return RequestResult(
        request_id,
        0.0,
        100,
        4,
        status=200,
        route=route,
        decode_node=node,
        ttft_s=ttft_s,
        usage={"completion_tokens": 4},
    )


def test_agreeing_requests_give_the_ratio_and_the_others_are_counted_by_measured_path() -> None:
    results = [
        served("a", "keep", "d0", 1.2),  # agrees: x1.2
        served("b", "keep", "d0", 2.2),  # agrees: x1.1
        served("c", "keep", "d1", 3.0),  # same route, other node: not in the ratio
        served("d", "deflect", "d0", 0.5),  # agrees: x1.25
        served("e", "deflect", "d1", 4.0),  # the simulator kept it
        RequestResult("f", 0.0, 100, 4, status=503, error="no node"),  # failed: left out
    ]
    sim = {
        "a": SimOutcome(1.0, "keep", "d0"),
        "b": SimOutcome(2.0, "keep", "d0"),
        "c": SimOutcome(1.0, "keep", "d0"),
        "d": SimOutcome(0.4, "deflect", "d0"),
        "e": SimOutcome(1.0, "keep", "d1"),
        "f": SimOutcome(1.0, "keep", "d0"),
    }
    out = fidelity(results, sim)
    assert out["requests"] == 5
    assert out["same_route"] == pytest.approx(4 / 5)
    assert out["same_route_and_node"] == pytest.approx(3 / 5)
    assert out["agreeing"]["keep"]["requests"] == 2
    assert out["agreeing"]["keep"]["median_measured_over_sim"] == pytest.approx(1.2)  # upper median of 1.1, 1.2
    assert out["agreeing"]["deflect"]["median_measured_minus_sim_s"] == pytest.approx(0.1)
    assert out["only_measured_deflect"] == {"requests": 1, "p95_ttft_s": 4.0}
    assert out["only_measured_keep"] == {"requests": 0, "p95_ttft_s": None}
    line = format_fidelity(out)
    assert "same route 80%" in line and "keep x1.20" in line and "deflect x1.25" in line


def test_no_served_request_gives_empty_figures() -> None:
    out = fidelity([RequestResult("a", 0.0, 10, 4, status=0, error="refused")], {"a": SimOutcome(1.0, "keep", "d0")})
    assert out["requests"] == 0 and out["agreeing"] == {}
    assert "where they agree, median measured/sim TTFT: -" in format_fidelity(out)
