"""``kairos top``'s screen from fixed inputs: two scrapes of a dispatcher (its real metrics
classes, exposed in Prometheus's text format) and its ``/nodes``, rendered to the exact text."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kairos.core.decision import Reason, Route
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.extproc.metrics import ClusterCollector, DispatcherMetrics
from kairos.launcher import top
from kairos.nodeagent.sidecar import SidecarMetrics
from tests.observability import rules

NODES: dict[str, Any] = {
    "status": "ok",
    "static_fallback": False,
    "nodes": [
        {
            "id": "d0",
            "role": "decode",
            "age_s": 0.04,
            "stale": False,
            "from_redis": True,
            "decode_tokens": 3,
            "kv_tokens": 13000,
            "kv_capacity_tokens": 1300000,
            "queued_prefill_tokens": 0,
            "scheduled_prefill_tokens": 612,
            "step_calibration": 2.375,  # over the line: flagged
        },
        {
            "id": "d1",
            "role": "decode",
            "age_s": 0.05,
            "stale": False,
            "from_redis": True,
            "decode_tokens": 1,
            "kv_tokens": 500,
            "kv_capacity_tokens": 1300000,
            "queued_prefill_tokens": 0,
            "scheduled_prefill_tokens": 0,
            "step_calibration": 1.5,  # at the line is not over it
        },
        {
            "id": "p0",
            "role": "prefill",
            "age_s": 1.5,
            "stale": True,
            "from_redis": True,
            "decode_tokens": 0,
            "kv_tokens": 0,
            "kv_capacity_tokens": 1300000,
            "queued_prefill_tokens": 4000,
            "scheduled_prefill_tokens": 0,
        },
        {"id": "p9", "role": "prefill", "age_s": 0.0, "stale": False, "from_redis": False},  # static fallback
    ],
}


class _Cluster:
    def __init__(self, degraded: bool) -> None:
        self.degraded = degraded

    def view(self) -> ClusterView:
        return ClusterView(
            prefill=(PrefillNodeState.from_queue("p0", (4000,), 2048, reported_at=8.5),),
            decode=(DecodeNodeState("d0", 3, 13000, 1300000, reported_at=9.96),),
        )

    def now(self) -> float:
        return 10.0


def _metrics_text(keeps: int, deflects: int, *, degraded: bool = False, mape: float | None = None) -> str:
    """A dispatcher's /metrics after ``keeps`` and ``deflects`` decisions (every keep predicted at
    150 ms and observed 10% slower; every deflect predicted at 100 ms, no feedback yet)."""
    m = DispatcherMetrics(CollectorRegistry())
    m.registry.register(ClusterCollector(_Cluster(degraded)))
    m.set_profile("tiny-cpu", "0123abcd", "/w/profile.json")
    m.decisions.labels(route=Route.KEEP.value, reason=Reason.KEEP_DECODE_SLOWER.value).inc(keeps)
    m.decisions.labels(route=Route.DEFLECT.value, reason=Reason.DEFLECT_WITHIN_MARGIN.value).inc(deflects)
    for _ in range(keeps + deflects):
        m.decision_seconds.observe(0.001)
    for _ in range(keeps):
        m.predicted_ttft.labels(route="keep").observe(0.150)
        m.ttft_observed_over_predicted.labels(path="keep").observe(1.1)
    for _ in range(deflects):
        m.predicted_ttft.labels(route="deflect").observe(0.100)
    # One split per 3 deflects, its prefill node computing 60% of its prompt.
    m.decisions.labels(route=Route.SPLIT.value, reason=Reason.SPLIT_WITHIN_MARGIN.value).inc(deflects // 3)
    for _ in range(deflects // 3):
        m.predicted_ttft.labels(route="split").observe(0.200)
        m.split_share.observe(0.6)
    if mape is not None:
        m.ttft_prediction_mape.labels(path="keep").set(mape)
    # Admission: 512 + keeps in flight of 1,024, 3 waiting; a 429 per deflect, and one busy one.
    m.admission_budget.set(1024)
    m.admission_in_flight.set(512 + keeps)
    m.admission_waiting.set(3)
    m.shed.labels(reason="queue_full").inc(deflects)
    m.shed.labels(reason="open_streams").inc()
    return generate_latest(m.registry).decode()


def scrape(at: float, keeps: int, deflects: int, **kw: Any) -> top.Scrape:
    return top.Scrape(at, NODES, top.parse_metrics(_metrics_text(keeps, deflects, **kw)))


def frame(
    previous: top.Scrape | None, current: top.Scrape, alerts: list[top.Alert] | None, alerts_from: str = "local"
) -> top.Frame:
    return top.Frame("http://127.0.0.1:9100", "12:00:00", 1.0, current, previous, alerts, alerts_from)


EXPECTED = """\
kairos top  http://127.0.0.1:9100  12:00:00  refresh 1 s
status ok
profile tiny-cpu (/w/profile.json)

NODE       ROLE     BATCH            KV IN USE QUEUED PREFILL DEFLECTED STEP/PROFILE HEARTBEAT
d0         decode       3   13000/1300000 (1%)              0       612        x2.38    0.04 s SLOW
d1         decode       1     500/1300000 (0%)              0         0        x1.50    0.05 s
p0         prefill      0       0/1300000 (0%)           4000         0            -    1.50 s STALE
p9         prefill      -                    -              -         -            -    0.00 s STATIC
SLOW d0: steps up to 2.38x its profile's (p99): a loaded host, or a profile of other hardware
     its chunks are planned to the step budget / 2.38; deflect TTFT predictions there are not scaled

DECISIONS  6.0/s, 33% deflected, 17% split   mean decision time 1.00 ms
  splits: the prefill node computes 60% of the prompt on average (k), the decode node the rest
  deflect  deflect_within_margin                    2.00/s        6 total
  keep     keep_decode_slower                       3.00/s       16 total
  split    split_within_margin                      1.00/s        2 total
BY CLASS   (no decisions yet)
ADMISSION  in flight 528/1024 (52%), 3 waiting   shed (429) 2.0/s, 7 total (open_streams 1, queue_full 6)

TTFT       predicted mean observed/predicted  live MAPE  samples
  keep            0.150 s               1.10      30.0%       16
  deflect         0.100 s                  -          -        0
  split           0.200 s                  -          -        0

ALERTS (local): 2 firing
  FIRING  warning  KairosNodeHeartbeatStale     prefill node p0: last heartbeat 1.5 s ago
  FIRING  warning  KairosTtftPredictionDrift    keep TTFT predictions off by 30% (MAPE)
"""


def test_render_shows_nodes_decision_rates_ttft_and_local_alerts() -> None:
    # Two scrapes 2 s apart: 6 keeps and 4 deflections in between.
    current = scrape(12.0, 16, 6, mape=0.30)
    shown = top.render(frame(scrape(10.0, 10, 2, mape=0.30), current, top.local_alerts(current)))
    assert shown == EXPECTED


def test_slow_nodes_are_those_whose_steps_run_over_the_line_against_their_profile() -> None:
    assert top.slow_nodes(NODES["nodes"]) == [("d0", 2.375)]  # d1 at the line, prefill nodes report none
    calm = [{**n, "step_calibration": 1.2} if n["role"] == "decode" else n for n in NODES["nodes"]]
    shown = top.render(frame(None, top.Scrape(1.0, {**NODES, "nodes": calm}, scrape(1.0, 0, 0).metrics), []))
    assert "SLOW" not in shown and "x1.20" in shown


def test_the_first_frame_has_no_rates_yet() -> None:
    shown = top.render(frame(None, scrape(12.0, 16, 6), []))
    assert "DECISIONS  -   mean decision time 1.00 ms" in shown
    assert re.search(r"^  keep +keep_decode_slower +- +16 total$", shown, re.M)
    assert "ALERTS (local): 0 firing" in shown
    assert (
        "ADMISSION  in flight 528/1024 (52%), 3 waiting   shed (429) -, 7 total (open_streams 1, queue_full 6)" in shown
    )


def _sidecar(judged: dict[tuple[str, str], int], goodput: dict[str, int]) -> top.Metrics:
    """A sidecar's /kairos/metrics (its real metrics class) after ``judged`` requests by (class,
    outcome) and ``goodput`` tokens by class."""
    m = SidecarMetrics()
    for key, n in judged.items():
        m.slo_requests[key].inc(n)
    for name, n in goodput.items():
        m.slo_goodput_tokens[name].inc(n)
    return top.parse_metrics(generate_latest(m.registry).decode())


def test_by_class_decisions_and_over_the_frame_each_class_attainment_and_goodput() -> None:
    m = DispatcherMetrics(CollectorRegistry())
    idle = top.Scrape(1.0, NODES, top.parse_metrics(generate_latest(m.registry).decode()))
    assert "BY CLASS   (no decisions yet)\n" in top.render(frame(idle, idle, []))
    m.class_decisions.labels("interactive", "keep").inc(3)
    m.class_decisions.labels("interactive", "deflect").inc(2)
    m.class_decisions.labels("batch", "keep").inc(7)
    dispatcher = top.parse_metrics(generate_latest(m.registry).decode())
    # Two sidecars read 2 s apart. Over the frame: interactive met 20 + 18 and missed 2 (95%),
    # 1,000 tokens of goodput (500 tok/s); batch met 9 (d1 restarted: counted from zero), 2,700
    # tokens (1,350 tok/s); standard only unobserved: judged, but none met or missed. d2's
    # sidecar answered only now: it has no increase yet, and adds nothing.
    before = {
        "d0": _sidecar({("interactive", "met"): 10, ("batch", "met"): 4}, {"interactive": 200, "batch": 4000}),
        "d1": _sidecar({("interactive", "met"): 5, ("batch", "met"): 12}, {"interactive": 100, "batch": 5000}),
    }
    now = {
        "d0": _sidecar(
            {("interactive", "met"): 30, ("interactive", "missed"): 2, ("batch", "met"): 4},
            {"interactive": 700, "batch": 4000},
        ),
        "d1": _sidecar(
            {("interactive", "met"): 23, ("batch", "met"): 9, ("standard", "unobserved"): 3},
            {"interactive": 600, "batch": 2700},
        ),
        "d2": _sidecar({("batch", "met"): 50}, {"batch": 99_999}),
    }
    previous = top.Scrape(1.0, NODES, dispatcher, before)
    shown = top.render(frame(previous, top.Scrape(3.0, NODES, dispatcher, now), []))
    assert (
        "BY CLASS       decisions                                 SLO met        goodput\n"
        "  interactive  5 (deflect 2, keep 3)                 95.0% of 40    500.0 tok/s\n"
        "  standard     0                                               -      0.0 tok/s\n"
        "  batch        7 (keep 7)                            100.0% of 9   1350.0 tok/s\n"
    ) in shown
    # The first frame has no increase yet; nor has a frame without any sidecar read twice.
    for first in (frame(None, previous, []), frame(top.Scrape(0.0, NODES, dispatcher), previous, [])):
        assert "  interactive  5 (deflect 2, keep 3)                           -              -\n" in top.render(first)


def test_the_admission_line_says_when_no_check_has_run_and_nothing_was_shed() -> None:
    m = DispatcherMetrics(CollectorRegistry())  # --admission off: the gauges are never set
    idle = top.Scrape(1.0, NODES, top.parse_metrics(generate_latest(m.registry).decode()))
    shown = top.render(frame(idle, top.Scrape(2.0, NODES, idle.metrics), []))
    assert "ADMISSION  in flight - (no check yet), 0 waiting   shed (429) 0.0/s, 0 total\n" in shown


def test_local_alerts_follow_the_rules_thresholds() -> None:
    assert top.local_alerts(scrape(1.0, 1, 0, mape=0.25)) == [  # at the limit is not over it
        top.Alert("KairosNodeHeartbeatStale", "warning", "prefill node p0: last heartbeat 1.5 s ago")
    ]
    degraded = top.local_alerts(scrape(1.0, 1, 0, degraded=True))
    assert [a.name for a in degraded] == ["KairosNodeHeartbeatStale", "KairosDispatcherDegraded"]
    exprs = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    assert exprs["KairosNodeHeartbeatStale"].endswith(f"> {top.STALE_HEARTBEAT_S:g}")
    drift = exprs["KairosTtftPredictionDrift"]
    assert f"> {top.TTFT_MAPE_LIMIT:g} and " in drift and drift.endswith(f">= {top.TTFT_MIN_SAMPLES}")
    assert exprs["KairosDispatcherDegraded"] == "kairos_dispatcher_degraded == 1"


def test_the_drift_alert_needs_enough_samples() -> None:
    assert top.local_alerts(scrape(1.0, 16, 0, mape=0.30))[-1].name == "KairosTtftPredictionDrift"
    few = top.local_alerts(scrape(1.0, top.TTFT_MIN_SAMPLES - 1, 0, mape=0.30))
    assert "KairosTtftPredictionDrift" not in [a.name for a in few]


def test_prometheus_alerts_firing_first_then_pending() -> None:
    payload = {
        "status": "success",
        "data": {
            "alerts": [
                {
                    "labels": {"alertname": "KairosTtftPredictionDrift", "severity": "warning", "path": "keep"},
                    "annotations": {"summary": "keep TTFT predictions off by 40% (MAPE)"},
                    "state": "pending",
                },
                {
                    "labels": {"alertname": "KairosDispatcherDegraded", "severity": "critical"},
                    "annotations": {"summary": "dispatcher a:9100 cannot reach Redis"},
                    "state": "firing",
                },
            ]
        },
    }
    alerts = top.prometheus_alerts(payload)
    shown = top.render(frame(None, scrape(1.0, 0, 0), alerts, "prometheus http://127.0.0.1:9090"))
    assert shown.endswith(
        "ALERTS (prometheus http://127.0.0.1:9090): 1 firing\n"
        "  FIRING  critical KairosDispatcherDegraded     dispatcher a:9100 cannot reach Redis\n"
        "  PENDING warning  KairosTtftPredictionDrift    keep TTFT predictions off by 40% (MAPE)\n"
    )


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(
        **{"dispatcher": "http://d:9100/", "prometheus": None, "interval": 1.0, "timeout": 5.0, **kw}
    )


def test_next_frame_reads_the_dispatcher_and_says_what_it_could_not_reach() -> None:
    answers = {"http://d:9100/nodes": json.dumps(NODES).encode(), "http://d:9100/metrics": _metrics_text(1, 0).encode()}

    def fetch(url: str, timeout_s: float) -> bytes:
        if url not in answers:
            raise OSError(f"connection refused: {url}")
        return answers[url]

    ok = top.next_frame(_args(), None, fetch)
    assert (
        ok.scrape is not None and ok.errors == [] and [a.name for a in ok.alerts or []] == ["KairosNodeHeartbeatStale"]
    )
    with_prometheus = top.next_frame(_args(prometheus="http://prom:9090"), ok.scrape, fetch)
    assert with_prometheus.alerts is None and with_prometheus.errors == [
        "prometheus http://prom:9090: connection refused: http://prom:9090/api/v1/alerts"
    ]
    assert "ALERTS (prometheus http://prom:9090): unknown" in top.render(with_prometheus)
    # The decode nodes' sidecars, from /nodes: each one's metrics read; one that does not answer said.
    with_sidecars = {
        **NODES,
        "nodes": [
            {**n, "sidecar": f"10.0.0.{i}:8201"} if n["role"] == "decode" else n for i, n in enumerate(NODES["nodes"])
        ],
    }
    answers["http://d:9100/nodes"] = json.dumps(with_sidecars).encode()
    answers["http://10.0.0.0:8201/kairos/metrics"] = generate_latest(SidecarMetrics().registry)
    read = top.next_frame(_args(), ok.scrape, fetch)
    assert read.scrape is not None and list(read.scrape.sidecars) == ["d0"]
    assert read.scrape.sidecar_total("kairos_sidecar_slo_requests_total") == 0
    assert read.scrape.sidecars["d0"]["kairos_sidecar_slo_requests_total"]  # its series, read
    assert read.errors == ["sidecar of d1 10.0.0.1:8201: connection refused: http://10.0.0.1:8201/kairos/metrics"]
    gone = top.next_frame(_args(dispatcher="http://gone:9100"), ok.scrape, fetch)
    assert gone.scrape is None and gone.previous is None
    assert (
        top.render(gone).splitlines()[1] == "! dispatcher http://gone:9100: connection refused: http://gone:9100/nodes"
    )


@pytest.mark.parametrize("argv", [["top"], ["top", "--dispatcher", "http://x:1", "--prometheus", "http://p:2"]])
def test_the_top_subcommand_parses(argv: list[str]) -> None:
    from kairos.launcher.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.handler is top.run and args.interval == 1.0
