"""The dispatcher's scrape-time cluster metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.extproc.metrics import ClusterCollector


@dataclass
class StaticCluster:
    degraded: bool
    at: float

    def view(self) -> ClusterView:
        return ClusterView(
            prefill=(PrefillNodeState.from_queue("p0", (), 2048, reported_at=9.75),),
            decode=(DecodeNodeState("d0", 3, 900, 10_000, reported_at=9.5),),
        )

    def now(self) -> float:
        return self.at


def scrape(cluster: StaticCluster) -> str:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(cluster))
    return generate_latest(registry).decode()


def test_heartbeat_age_per_node_and_the_degraded_flag() -> None:
    text = scrape(StaticCluster(degraded=False, at=10.0))
    assert 'kairos_dispatcher_heartbeat_age_seconds{node="p0",role="prefill"} 0.25' in text
    assert 'kairos_dispatcher_heartbeat_age_seconds{node="d0",role="decode"} 0.5' in text
    assert "kairos_dispatcher_degraded 0.0" in text
    assert "kairos_dispatcher_degraded 1.0" in scrape(StaticCluster(degraded=True, at=10.0))
