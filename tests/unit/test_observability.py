"""The dashboard and the Prometheus rules read only metrics the code exports, under the names it
exports them (a renamed metric fails here, before an operator finds an empty panel)."""

from __future__ import annotations

import itertools
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from kairos.common.contracts import STEP_BUDGET_OVERRUNS_HELP, STEP_BUDGET_OVERRUNS_METRIC, Role
from kairos.core.state import ClusterView, DecodeNodeState
from kairos.extproc.cluster import redis_error_counter
from kairos.extproc.metrics import ClusterCollector, DispatcherMetrics, promises_heard_counter
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig, NodeProcs
from kairos.launcher.vllm_cluster import VllmCluster
from kairos.nodeagent.sidecar import SidecarMetrics
from kairos.sim.emulated_vllm.metrics import Metrics as EmulatedNodeMetrics
from tests.observability import dashboard, dashboard_queries, metric_names, recorded_names, rules

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


class _OneNodeCluster:
    degraded = False

    def view(self) -> ClusterView:
        return ClusterView(decode=(DecodeNodeState("d0", 0, 0, 100, reported_at=1.0),))

    def now(self) -> float:
        return 2.0


def _series_names(families: list[Metric]) -> set[str]:
    return {family.name + suffix for family in families for suffix in _SUFFIXES[family.type]}


def exported_names() -> set[str]:
    """Every series name the dispatcher, the sidecar and the nodes can export."""
    dispatcher = DispatcherMetrics(CollectorRegistry())
    redis_error_counter(dispatcher.registry)
    promises_heard_counter(dispatcher.registry)  # the cluster view registers both on the dispatcher's
    dispatcher.registry.register(ClusterCollector(_OneNodeCluster()))
    registries = [dispatcher.registry, SidecarMetrics().registry, EmulatedNodeMetrics.create("m").registry]
    names = _series_names([f for r in registries for f in r.collect()])
    assert f"{STEP_BUDGET_OVERRUNS_METRIC}_total" in names and STEP_BUDGET_OVERRUNS_HELP  # the plugin's too
    return names


def test_every_dashboard_query_reads_exported_metrics() -> None:
    exported = exported_names()
    queries = dashboard_queries()
    assert len(queries) >= 20
    unknown = {where: sorted(metric_names(expr) - exported) for where, expr in queries}
    assert {where: names for where, names in unknown.items() if names} == {}
    assert all(metric_names(expr) for _, expr in queries)  # each reads something


def test_the_dashboard_covers_what_operators_asked_for() -> None:
    read = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert {
        "kairos_dispatcher_decisions_total",
        "kairos_dispatcher_predicted_ttft_seconds_bucket",
        "kairos_sidecar_ttft_seconds_bucket",
        "kairos_dispatcher_ttft_prediction_mape",
        "kairos_dispatcher_decision_seconds_bucket",
        "kairos_dispatcher_heartbeat_age_seconds",
        "kairos_dispatcher_degraded",
        "kairos_dispatcher_redis_errors_total",
        "kairos_dispatcher_reservation_conflicts_total",
        "kairos_sidecar_hop1_seconds_bucket",
        "kairos_sidecar_ttfb_seconds_bucket",
        "kairos_sidecar_hop_errors_total",
        "kairos_dispatcher_profile_reloads_total",
        "kairos_node_step_budget_overruns_total",
        "kairos_dispatcher_shed_total",
        "kairos_dispatcher_admission_waited_total",
        "kairos_dispatcher_admission_in_flight",
        "kairos_dispatcher_admission_budget",
        "kairos_dispatcher_admission_waiting",
        "kairos_dispatcher_class_decisions_total",
        "kairos_sidecar_slo_requests_total",
        "kairos_sidecar_slo_goodput_tokens_total",
        "kairos_dispatcher_split_prefill_share_bucket",
        "kairos_sidecar_split_degraded_total",
    } <= read


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
    for panel in panels:
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
    cells = [
        {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        for g in (p["gridPos"] for p in panels)
    ]
    assert all(max(x for x, _ in c) < 24 for c in cells)  # within Grafana's 24 columns
    assert all(not a & b for a, b in itertools.combinations(cells, 2))  # no panel covers another


def test_rules_read_exported_metrics_or_recorded_ones() -> None:
    exported = exported_names()
    all_rules = rules()
    recorded = {r["record"] for r in all_rules if "record" in r}
    for rule in all_rules:
        assert metric_names(rule["expr"]) <= exported, rule
        assert recorded_names(rule["expr"]) <= recorded, rule
    alerts = {r["alert"]: r for r in all_rules if "alert" in r}
    assert set(alerts) == {
        "KairosNodeHeartbeatStale",
        "KairosNodeLeft",
        "KairosDispatcherDegraded",
        "KairosTtftPredictionDrift",
        "KairosSidecarHopErrors",
        "KairosDecodeStepBudgetOverruns",
        "KairosShedding",
    }
    assert all(
        r["labels"]["severity"] in {"warning", "critical"} and r["annotations"]["summary"] for r in alerts.values()
    )


def test_the_clusters_prometheus_targets_name_every_metrics_endpoint(tmp_path: Path) -> None:
    nodes = [NodeProcs("p0", Role.PREFILL, 8100, None), NodeProcs("d0", Role.DECODE, 8101, 8201)]
    emulated = LocalCluster(LocalClusterConfig(), tmp_path, nodes=nodes, dispatcher_metrics_ports=[9100, 9101])
    assert emulated.prometheus_targets() == [
        {"targets": ["127.0.0.1:9100", "127.0.0.1:9101"], "labels": {"job": "kairos-dispatcher"}},
        {"targets": ["127.0.0.1:8100"], "labels": {"job": "kairos-node", "node": "p0", "role": "prefill"}},
        {"targets": ["127.0.0.1:8101"], "labels": {"job": "kairos-node", "node": "d0", "role": "decode"}},
        {
            "targets": ["127.0.0.1:8201"],
            "labels": {"job": "kairos-sidecar", "__metrics_path__": "/kairos/metrics", "node": "d0", "role": "decode"},
        },
    ]
    vllm = VllmCluster(
        LocalClusterConfig(),
        tmp_path,
        nodes=nodes,
        dispatcher_metrics_ports=[9100],
        state_ports={"p0": 8300, "d0": 8301},
    )
    assert vllm.prometheus_targets()[-2:] == [  # the plugin's state server: step-budget overruns
        {"targets": ["127.0.0.1:8300"], "labels": {"job": "kairos-node-state", "node": "p0", "role": "prefill"}},
        {"targets": ["127.0.0.1:8301"], "labels": {"job": "kairos-node-state", "node": "d0", "role": "decode"}},
    ]
