"""bench/live/main_job_mape.py's own logic: the traffic it sends, where it finds the sidecars, and how it
reads the dispatcher's metrics and ``kairos top``'s alerts into per-path figures and the target."""

from __future__ import annotations

import json
from pathlib import Path

from bench.live.main_job_mape import (
    MAX_TOKENS,
    MAX_WORDS,
    MIN_TOKENS,
    MIN_WORDS,
    alert_lines,
    make_requests,
    per_path,
    sidecar_urls,
    target_met,
)
from kairos.common.contracts import SIDECAR_METRICS_PATH
from kairos.launcher.top import parse_metrics

DISPATCHER = """\
kairos_dispatcher_decisions_total{reason="keep_slo_room",route="keep"} 30.0
kairos_dispatcher_decisions_total{reason="keep_decode_overloaded",route="keep"} 10.0
kairos_dispatcher_decisions_total{reason="deflect_within_margin",route="deflect"} 4.0
kairos_dispatcher_ttft_observed_over_predicted_count{path="keep"} 20.0
kairos_dispatcher_ttft_observed_over_predicted_sum{path="keep"} 22.0
kairos_dispatcher_ttft_observed_over_predicted_count{path="deflect"} 0.0
kairos_dispatcher_ttft_observed_over_predicted_sum{path="deflect"} 0.0
kairos_dispatcher_ttft_prediction_mape{path="keep"} 0.12
"""

TOP = """\
TTFT       predicted mean observed/predicted  live MAPE  samples
  keep            0.159 s               1.10      12.0%       20

ALERTS (local): 1 firing
  FIRING  warning  KairosTtftPredictionDrift    keep TTFT predictions off by 30% (MAPE)
"""


def test_half_the_requests_stream_with_prompts_and_lengths_in_range() -> None:
    requests = make_requests(40, seed=1)
    assert sum(bool(r.get("stream")) for r in requests) == 20
    assert all(MIN_WORDS <= len(r["prompt"].split()) <= MAX_WORDS for r in requests)
    assert all(MIN_TOKENS <= r["max_tokens"] <= MAX_TOKENS for r in requests)
    assert make_requests(40, seed=1) == requests and make_requests(40, seed=2) != requests
    assert [bool(r.get("stream")) for r in requests] != [i % 2 == 0 for i in range(40)]  # shuffled together


def test_the_sidecars_come_from_kairos_ups_prometheus_targets(tmp_path: Path) -> None:
    targets = [
        {"targets": ["127.0.0.1:9100"], "labels": {"job": "kairos-dispatcher"}},
        {"targets": ["127.0.0.1:8101"], "labels": {"job": "kairos-node", "node": "d0", "role": "decode"}},
        {
            "targets": ["127.0.0.1:8201"],
            "labels": {"job": "kairos-sidecar", "__metrics_path__": SIDECAR_METRICS_PATH, "node": "d0"},
        },
    ]
    path = tmp_path / "prometheus-targets.json"
    path.write_text(json.dumps(targets))
    assert sidecar_urls(path) == [f"http://127.0.0.1:8201{SIDECAR_METRICS_PATH}"]


def test_per_path_figures_alerts_and_the_target() -> None:
    paths = per_path(parse_metrics(DISPATCHER))
    assert paths["keep"] == {"decisions": 40, "samples": 20, "live_mape": 0.12, "observed_over_predicted_mean": 1.1}
    assert paths["deflect"] == {"decisions": 4, "samples": 0, "live_mape": None, "observed_over_predicted_mean": None}
    alerts = alert_lines(TOP)
    assert alerts == TOP.splitlines()[3:5]
    assert not target_met(paths, alerts)  # an alert fires
    assert target_met(paths, alerts[:1])
    worse = {**paths, "keep": {**paths["keep"], "live_mape": 0.21}}
    assert not target_met(worse, alerts[:1])
