"""Prometheus metrics of the dispatcher, in one registry per process (tests pass their own)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from extproc.decision import Decision
from extproc.state import ClusterView

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class DispatcherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kairos_dispatcher_decisions_total",
            "Routing decisions by outcome and reason",
            ["route", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kairos_dispatcher_decision_seconds",
            "Time from request body to routing answer (parsing and tokenization included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "kairos_dispatcher_predicted_ttft_seconds",
            "Predicted TTFT of the chosen path",
            ["route"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "kairos_dispatcher_rejections_total",
            "Requests answered with an error by the dispatcher",
            ["code"],
            registry=r,
        )
        self.reservation_conflicts = Counter(
            "kairos_dispatcher_reservation_conflicts_total",
            "Deflections given up because another dispatcher reserved the decode node first",
            registry=r,
        )

    def observe_decision(self, decision: Decision, seconds: float) -> None:
        self.decisions.labels(route=decision.route.value, reason=decision.reason.value).inc()
        self.decision_seconds.observe(seconds)
        predicted = (
            decision.predicted_ttft_decode_s if decision.route.value == "deflect" else decision.predicted_ttft_prefill_s
        )
        if predicted is not None:
            self.predicted_ttft.labels(route=decision.route.value).observe(predicted)


class ClusterCollector:
    """Exports the live cluster view at scrape time: heartbeat age per node (a node whose age
    keeps growing is stale, then gone) and whether the dispatcher runs degraded (Redis lost)."""

    def __init__(self, cluster: ClusterLike) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self.cluster.view()
        now = self.cluster.now()
        age = GaugeMetricFamily(
            "kairos_dispatcher_heartbeat_age_seconds",
            "Seconds since each node's last heartbeat",
            labels=["node", "role"],
        )
        for node in view.prefill:
            age.add_metric([node.node_id, "prefill"], max(0.0, now - node.reported_at))
        for node in view.decode:
            age.add_metric([node.node_id, "decode"], max(0.0, now - node.reported_at))
        yield age
        degraded = GaugeMetricFamily("kairos_dispatcher_degraded", "1 while Redis is unreachable (P/D routing only)")
        degraded.add_metric([], 1.0 if self.cluster.degraded else 0.0)
        yield degraded


class ClusterLike(Protocol):
    @property
    def degraded(self) -> bool: ...

    def view(self) -> ClusterView: ...

    def now(self) -> float: ...
