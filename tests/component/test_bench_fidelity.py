"""bench/live/replay.py's comparisons of a replay with the simulator: request by request, and the
keep path's two halves from the sidecars' histograms."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import msgspec
import pytest

from bench.live.replay import (
    SimOutcome,
    decode_step_calibrations,
    fidelity,
    format_fidelity,
    format_keep_parts,
    keep_parts_fidelity,
    scrape_keep_parts,
)
from kairos.common.contracts import Role, encode_heartbeat
from kairos.extproc.membership import Membership, MembershipConfig
from kairos.launcher.replay import RequestResult
from tests.unit.test_heartbeat_contract import BEAT


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


METRICS = """\
# HELP kairos_sidecar_hop1_seconds hop 1
kairos_sidecar_hop1_seconds_sum{path="keep"} 3.0
kairos_sidecar_hop1_seconds_count{path="keep"} 4.0
kairos_sidecar_hop1_seconds_sum{path="deflect"} 99.0
kairos_sidecar_ttft_seconds_sum{path="keep"} 5.0
kairos_sidecar_ttft_seconds_count{path="keep"} 4.0
kairos_sidecar_ttft_seconds_sum{path="deflect"} 99.0
kairos_sidecar_ttft_seconds_count{path="deflect"} 9.0
"""


@pytest.fixture
def sidecar_metrics() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            assert self.path == "/kairos/metrics"
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # keep pytest's output clean

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_keep_parts_come_from_the_sidecars_keep_histograms_in_model_time(sidecar_metrics: str) -> None:
    before = (0.5, 1.0, 1)  # the low-load check's request, scraped before the replay
    after = scrape_keep_parts([sidecar_metrics, sidecar_metrics])  # two sidecars, summed
    assert after == (6.0, 10.0, 8)
    sim = {
        "a": SimOutcome(1.0, "keep", "d0", (0.6, 0.4)),
        "b": SimOutcome(2.0, "keep", "d1", (1.4, 0.6)),
        "c": SimOutcome(0.3, "deflect", "d0"),
    }
    parts = keep_parts_fidelity(before, after, 2.0, sim)
    assert parts is not None and parts["requests_measured"] == 7 and parts["requests_simulated"] == 2
    assert parts["mean_until_prefilled_s"]["measured"] == pytest.approx(5.5 / 7 * 2)
    assert parts["mean_prefilled_to_first_token_s"]["measured"] == pytest.approx((9.0 - 5.5) / 7 * 2)
    assert parts["mean_until_prefilled_s"]["sim"] == pytest.approx(1.0)
    assert parts["mean_prefilled_to_first_token_s"]["sim"] == pytest.approx(0.5)
    assert "mean until prefilled 1.571 s (sim 1.000)" in format_keep_parts(parts)
    assert keep_parts_fidelity(after, after, 2.0, sim) is None  # no keep request in between


def test_the_decode_nodes_step_calibration_is_read_from_the_dispatchers_nodes_report() -> None:
    """The field name is the heartbeat contract's, as the dispatcher's /nodes reports it."""
    membership = Membership(MembershipConfig())
    beats = [
        ("d0", encode_heartbeat(msgspec.structs.replace(BEAT, step_calibration=1.17))),
        ("d1", encode_heartbeat(msgspec.structs.replace(BEAT, node_id="d1"))),  # reports none
        ("p0", encode_heartbeat(msgspec.structs.replace(BEAT, node_id="p0", role=Role.PREFILL, sidecar=""))),
    ]
    membership.poll_succeeded(beats, 10.0)
    assert decode_step_calibrations(membership.report(10.0)) == {"d0": 1.17, "d1": None}
