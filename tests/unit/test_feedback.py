"""TTFT feedback on the dispatcher: parsing the sidecars' stream entries and the model-error metrics
they feed (ratio histogram and rolling MAPE per path). The Redis side is in test_cluster.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kairos.common.contracts import TTFT_FEEDBACK_FIRST_TOKEN
from kairos.common.contracts import TtftFeedbackField as F
from kairos.extproc.feedback import MalformedFeedback, TtftFeedback, parse_entry
from kairos.extproc.metrics import DispatcherMetrics

RATIO = "kairos_dispatcher_ttft_observed_over_predicted"
MAPE = "kairos_dispatcher_ttft_prediction_mape"
MALFORMED = "kairos_dispatcher_ttft_feedback_malformed_total"


def entry(path: str = "keep", predicted_ms: Any = 100, observed_ms: Any = 100, **extra: Any) -> dict[bytes, bytes]:
    fields = {F.REQUEST_ID: "r1", F.PATH: path, F.NODE: "d0", F.PREDICTED_MS: predicted_ms, F.OBSERVED_MS: observed_ms}
    fields[F.MEASURED] = TTFT_FEEDBACK_FIRST_TOKEN
    fields.update(extra)
    return {k.encode(): str(v).encode() for k, v in fields.items() if v is not None}


@pytest.fixture
def metrics() -> DispatcherMetrics:
    return DispatcherMetrics(CollectorRegistry())


def sample(metrics: DispatcherMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_an_entry_parses_into_a_sample() -> None:
    s = parse_entry(entry("deflect", predicted_ms="250.5", observed_ms="501.0"))
    assert (s.request_id, s.path, s.node) == ("r1", "deflect", "d0")
    assert (s.predicted_s, s.observed_s) == (0.2505, 0.501)
    assert s.ratio == pytest.approx(2.0) and s.abs_pct_error == pytest.approx(0.5)
    assert parse_entry({k.decode(): v.decode() for k, v in entry().items()}).path == "keep"  # str fields too


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (entry(path="local"), "path must be one of"),
        (entry(predicted_ms="soon"), "must be numbers"),
        (entry(predicted_ms=0), "must be finite and > 0"),
        (entry(observed_ms=-1), "must be finite and > 0"),
        (entry(observed_ms="inf"), "must be finite and > 0"),
        (entry(observed_ms="nan"), "must be finite and > 0"),
        (entry(**{F.NODE: None}), "missing fields ['node']"),
        # what an older sidecar sent: its non-streamed samples timed the whole generation
        (entry(**{F.MEASURED: None}), "missing fields ['measured'] (a sidecar older than the first-token contract"),
        (entry(**{F.MEASURED: "first_byte"}), "measured must be 'first_token', got 'first_byte'"),
        (None, "expected a field map, got NoneType"),
        # junk an attacker who may XADD writes: bounded, so it never reaches the MAPE
        (entry(predicted_ms=10_000_000, observed_ms=1), "must be <= 600000"),
        (entry(predicted_ms=600_001, observed_ms=600_000), "must be <= 600000"),
        (entry(predicted_ms=1000, observed_ms=0.5), "beyond 1000x either way"),
        (entry(predicted_ms=1, observed_ms=1001), "beyond 1000x either way"),
        (entry(**{F.REQUEST_ID: "r" * 257}), "request_id must be 1 to 256 characters"),
        (entry(**{F.NODE: ""}), "node must be 1 to 256 characters"),
    ],
)
def test_entries_that_break_the_contract_are_rejected(fields: Any, message: str) -> None:
    with pytest.raises(MalformedFeedback) as info:
        parse_entry(fields)
    assert message in str(info.value)


def test_the_bounds_hold_at_their_edges() -> None:
    assert parse_entry(entry(predicted_ms=600_000, observed_ms=600)).ratio == pytest.approx(1e-3)
    assert parse_entry(entry(predicted_ms=1, observed_ms=1000)).ratio == pytest.approx(1e3)


def test_an_entry_naming_no_decode_node_in_the_view_is_ignored_and_counted(metrics: DispatcherMetrics) -> None:
    fb = TtftFeedback(metrics, window=10)
    batch = [(b"1-0", entry("keep", 100, 50)), (b"2-0", entry("keep", 100, 100, **{F.NODE: "evil"}))]
    assert fb.add_entries(batch, decode_nodes={"d0", "d1"}) == 1
    assert sample(metrics, MALFORMED) == 1
    assert fb.mape("keep") == pytest.approx(1.0)
    with pytest.raises(MalformedFeedback, match="not a decode node in the view"):
        parse_entry(entry(**{F.NODE: "p0"}), decode_nodes={"d0"})


def test_the_mape_rolls_over_the_last_window_samples_of_each_path(metrics: DispatcherMetrics) -> None:
    fb = TtftFeedback(metrics, window=3)
    assert fb.mape("keep") is None and sample(metrics, MAPE, path="keep") is None  # absent, not 0
    # keep: errors 1.0 (100 vs 50), then 0.0, 0.5, 0.25: the first one rolls out of the window.
    batch = [
        (b"1-0", entry("keep", 100, 50)),
        (b"2-0", entry("keep", 200, 200)),
        (b"3-0", entry("keep", 150, 100)),
    ]
    assert fb.add_entries(batch) == 3
    assert sample(metrics, MAPE, path="keep") == pytest.approx(0.5)
    assert fb.add_entries([(b"4-0", entry("keep", 300, 400))]) == 1
    assert fb.mape("keep") == pytest.approx((0.0 + 0.5 + 0.25) / 3)
    assert sample(metrics, MAPE, path="keep") == pytest.approx(0.25)
    assert sample(metrics, MAPE, path="deflect") is None
    fb.add_entries([(b"5-0", entry("deflect", 100, 110))])
    assert sample(metrics, MAPE, path="deflect") == pytest.approx(10 / 110)
    # The ratio histogram keeps every sample (observed / predicted: 0.5, 1, 2/3, 4/3, 1.1).
    assert sample(metrics, f"{RATIO}_count", path="keep") == 4
    assert sample(metrics, f"{RATIO}_sum", path="keep") == pytest.approx(0.5 + 1 + 2 / 3 + 4 / 3)
    assert sample(metrics, f"{RATIO}_bucket", path="keep", le="0.5") == 1
    assert sample(metrics, f"{RATIO}_bucket", path="keep", le="1.0") == 3
    assert sample(metrics, f"{RATIO}_count", path="deflect") == 1
    assert fb.samples == 5


def test_malformed_entries_are_counted_and_logged_once(
    metrics: DispatcherMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    fb = TtftFeedback(metrics, window=10)
    with caplog.at_level(logging.WARNING, logger="kairos.extproc.feedback"):
        accepted = fb.add_entries(
            [(b"1-0", entry(path="?")), (b"2-0", entry("keep", 100, 100)), (b"3-0", entry(observed_ms="x"))]
        )
    assert accepted == 1 and fb.samples == 1
    assert sample(metrics, MALFORMED) == 2
    assert sample(metrics, MAPE, path="keep") == 0.0
    [record] = caplog.records
    assert "ignoring malformed TTFT feedback entry 1-0: path must be one of" in record.getMessage()


def test_the_window_must_hold_a_sample(metrics: DispatcherMetrics) -> None:
    with pytest.raises(ValueError, match="window"):
        TtftFeedback(metrics, window=0)
