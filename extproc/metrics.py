"""Prometheus metrics of the dispatcher, in one registry per process (tests pass their own)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kairos.common.contracts import Role
from kairos.common.contracts.routes import Route
from kairos.core.decision import Decision
from kairos.core.state import ClusterView

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# The sidecar's kairos_sidecar_ttft_observed_over_predicted buckets, so the two line up.
_RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
FEEDBACK_PATHS = tuple(route.value for route in Route)  # the TTFT feedback stream's paths


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
        # Bounded: the class is read off the request's SLO pair against the configured classes
        # (kairos.core.slo.classify), never a client's raw header value.
        self.class_decisions = Counter(
            "kairos_dispatcher_class_decisions",
            "Routing decisions by the request's SLO class (its x-slo-ttft-ms / x-slo-tpot-ms pair, or the "
            "cluster default's class) and route",
            ["class", "route"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kairos_dispatcher_decision_seconds",
            "Time from request body to routing answer (parsing and tokenization included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.policy_seconds = Histogram(
            "kairos_dispatcher_policy_seconds",
            "The routing policy's own compute per request: Algorithm 1 over the in-memory view, every "
            "reservation attempt summed (no parsing, no Redis round trip, no wait on the event loop)",
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
        # A split's k as a share of its prompt: how much of the prompt the prefill node computes.
        self.split_share = Histogram(
            "kairos_dispatcher_split_prefill_share",
            "Split decisions: the prompt's share its prefill node computes (k / prompt tokens); the decode node "
            "prefills the rest",
            buckets=(0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0),
            registry=r,
        )
        self.rejections = Counter(
            "kairos_dispatcher_rejections_total",
            "Requests answered with an error by the dispatcher",
            ["code"],
            registry=r,
        )
        # What the nodes' KV events predicted (kairos.extproc.kv_events), per route and the role of
        # the node holding the prefix: keep's prefill node (tokens it skips), keep's decode node
        # (tokens whose KV it need not pull), deflect's decode node (tokens it skips).
        self.prefix_hit_tokens = Counter(
            "kairos_dispatcher_prefix_hit_tokens",
            "Prompt tokens predicted cached on the chosen nodes, by route and node role (requests "
            "decided with a prefix lookup; divide by kairos_dispatcher_prefix_lookup_prompt_tokens_total)",
            ["route", "role"],
            registry=r,
        )
        self.prefix_lookup_prompt_tokens = Counter(
            "kairos_dispatcher_prefix_lookup_prompt_tokens",
            "Prompt tokens of the requests decided with a prefix lookup, by route",
            ["route"],
            registry=r,
        )
        for route, role in (
            (Route.KEEP, Role.PREFILL),
            (Route.KEEP, Role.DECODE),
            (Route.DEFLECT, Role.DECODE),
            (Route.SPLIT, Role.PREFILL),
            (Route.SPLIT, Role.DECODE),
        ):
            self.prefix_hit_tokens.labels(route=route, role=role)
            self.prefix_lookup_prompt_tokens.labels(route=route)
        # Batches (several prompts in one completions body) and n > 1 go to a decode sidecar whole;
        # each prompt's each choice comes back through the gateway, decided (and counted above) alone.
        self.fanouts = Counter(
            "kairos_dispatcher_fanouts",
            "Requests (batches, n > 1) sent to a decode sidecar to fan out, one request per prompt and choice "
            "back through the gateway",
            registry=r,
        )
        self.fanout_parts = Counter(
            "kairos_dispatcher_fanout_parts", "Requests the fanned-out requests were split into", registry=r
        )
        # Admission control (kairos.core.admission, kairos.extproc.admission).
        self.shed = Counter(
            "kairos_dispatcher_shed_total",
            "Requests refused by admission control with a 429: the cluster at its in-flight budget "
            "(queue_full = the waiting line was full, wait_timeout = no seat within the bounded wait) "
            "or the dispatcher itself too busy to decide in time (open_streams = more requests being "
            "decided than it decides within Envoy's message timeout)",
            ["reason"],
            registry=r,
        )
        for reason in ("queue_full", "wait_timeout", "open_streams"):
            self.shed.labels(reason=reason)
        self.admission_waited = Counter(
            "kairos_dispatcher_admission_waited_total",
            "Requests that waited at the dispatcher for a seat and got one",
            registry=r,
        )
        self.admission_waiting = Gauge(
            "kairos_dispatcher_admission_waiting", "Requests waiting at the dispatcher for a seat now", registry=r
        )
        self.admission_in_flight = Gauge(
            "kairos_dispatcher_admission_in_flight",
            "Requests the cluster holds as the view counts them now (and those being decided)",
            registry=r,
        )
        self.admission_budget = Gauge(
            "kairos_dispatcher_admission_budget",
            "Requests the cluster may hold at once (decode seats and a queue as deep), as the view counts them now",
            registry=r,
        )
        self.reservation_conflicts = Counter(
            "kairos_dispatcher_reservation_conflicts_total",
            "Deflection promises refused (other dispatchers promised the node more than the decision "
            "counted, or Redis did not answer); each request is decided again",
            registry=r,
        )

        # Latency profile hot reload (kairos.extproc.profile_watch).
        self.profile_reloads = Counter(
            "kairos_dispatcher_profile_reloads",
            "Reloads of a changed latency profile file: ok = swapped in, error = rejected (old models kept)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "error"):
            self.profile_reloads.labels(outcome=outcome)
        self.profile_info = Gauge(
            "kairos_dispatcher_profile_info",
            "The latency profile in use (always 1): its name, content hash (sha256 prefix) and source",
            ["name", "hash", "source"],
            registry=r,
        )
        # Live model error from the sidecars' TTFT samples (kairos.extproc.feedback, via Redis).
        self.ttft_observed_over_predicted = Histogram(
            "kairos_dispatcher_ttft_observed_over_predicted",
            "Observed TTFT (first token of a streamed response) at the decode sidecars divided by this path's "
            "predicted TTFT; non-streamed requests have no sample",
            ["path"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        for path in FEEDBACK_PATHS:
            self.ttft_observed_over_predicted.labels(path=path)
        self.ttft_prediction_mape = Gauge(
            "kairos_dispatcher_ttft_prediction_mape",
            "Mean of |predicted - observed| / observed TTFT over the last samples of each path (streamed "
            "requests' first tokens; a fraction: 0.1 = 10%); absent until the first sample",
            ["path"],
            registry=r,
        )
        self.ttft_feedback_malformed = Counter(
            "kairos_dispatcher_ttft_feedback_malformed",
            "TTFT feedback stream entries ignored: they break the contract or its bounds, or name no decode node "
            "in the view",
            registry=r,
        )

    def set_profile(self, name: str, digest: str, source: str) -> None:
        """Make ``kairos_dispatcher_profile_info`` show this profile, and only it."""
        self.profile_info.clear()
        self.profile_info.labels(name=name, hash=digest, source=source).set(1)

    def observe_decision(self, decision: Decision, seconds: float, slo_class: str | None = None) -> None:
        self.decisions.labels(route=decision.route.value, reason=decision.reason.value).inc()
        if slo_class is not None:
            self.class_decisions.labels(slo_class, decision.route.value).inc()
        self.decision_seconds.observe(seconds)
        predicted = (
            decision.predicted_ttft_prefill_s if decision.route is Route.KEEP else decision.predicted_ttft_decode_s
        )
        if decision.split_tokens:
            self.split_share.observe(decision.split_tokens / decision.prompt_tokens)
        if predicted is not None:
            self.predicted_ttft.labels(route=decision.route.value).observe(predicted)

    def observe_prefix_hits(self, decision: Decision, decode_hit: int) -> None:
        """A decision made with the nodes' prefix hits; ``decode_hit``: its decode node's."""
        route = decision.route.value
        self.prefix_lookup_prompt_tokens.labels(route=route).inc(decision.prompt_tokens)
        if decision.route is not Route.DEFLECT:  # keep and split: the prefill node's hit, and the decode node's
            self.prefix_hit_tokens.labels(route=route, role=Role.PREFILL).inc(decision.cached_tokens)
            self.prefix_hit_tokens.labels(route=route, role=Role.DECODE).inc(decode_hit)
        else:
            self.prefix_hit_tokens.labels(route=route, role=Role.DECODE).inc(decision.cached_tokens)


# The cluster view's counters, made once per registry (a test or a benchmark builds several
# views; prometheus_client refuses a name registered twice in one registry).
_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Counter]] = weakref.WeakKeyDictionary()


def _counter_once(
    registry: CollectorRegistry, name: str, documentation: str, label: str | None = None, values: Iterable[str] = ()
) -> Counter:
    """The registry's counter ``name``, made on first use with every ``label`` value exported at 0."""
    counters = _COUNTERS.setdefault(registry, {})
    counter = counters.get(name)
    if counter is None:
        counter = Counter(name, documentation, [label] if label else [], registry=registry)
        for value in values:
            counter.labels(value)  # every series from the start, at 0
        counters[name] = counter
    return counter


def heartbeats_rejected_counter(reasons: Iterable[str], registry: CollectorRegistry = REGISTRY) -> Counter:
    """``kairos_dispatcher_heartbeats_rejected_total{reason}`` (reasons: the membership rules'):
    the cluster view counts every heartbeat value it ignores."""
    return _counter_once(
        registry,
        "kairos_dispatcher_heartbeats_rejected",
        "Heartbeat values ignored, once per distinct value of a key: malformed, a node_id that is not its "
        "key's, or (nodes listed) an unlisted node or one reporting another role or address than listed",
        "reason",
        reasons,
    )


def reservations_forged_counter(registry: CollectorRegistry = REGISTRY) -> Counter:
    """``kairos_dispatcher_reservations_forged_total``."""
    return _counter_once(
        registry,
        "kairos_dispatcher_reservations_forged",
        "Promise sets cleaned of what no dispatcher writes (another type, an unparseable member, one dated "
        "in Redis's future)",
    )


PROMISE_OUTCOMES = ("added", "ignored", "malformed")


def promises_heard_counter(registry: CollectorRegistry = REGISTRY) -> Counter:
    """``kairos_dispatcher_promises_heard_total{outcome}``: the other dispatchers' promises heard
    on the channel and added to the view, ignored (its own, one already known, a node not in the
    view, one past the node's bound) or malformed (no dispatcher published it)."""
    return _counter_once(
        registry,
        "kairos_dispatcher_promises_heard",
        "Deflection promises heard on the promise channel, by what became of them",
        "outcome",
        PROMISE_OUTCOMES,
    )


_VIEW_AGE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_POLL_BUCKETS = (0.5e-3, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3)
_READ_DELAY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


@dataclass(frozen=True)
class ViewPollMetrics:
    """The cluster view's refresh: what a poll costs and how fresh the view is when it runs."""

    seconds: Histogram  # kairos_dispatcher_view_poll_seconds
    oldest_heartbeat: Histogram  # kairos_dispatcher_view_oldest_heartbeat_seconds
    lateness: Histogram  # kairos_dispatcher_view_poll_lateness_seconds
    read: Histogram  # kairos_dispatcher_view_read_seconds
    apply_wait: Histogram  # kairos_dispatcher_view_apply_wait_seconds
    read_delay: Histogram  # kairos_dispatcher_view_read_delay_seconds


_VIEW_POLL: weakref.WeakKeyDictionary[CollectorRegistry, ViewPollMetrics] = weakref.WeakKeyDictionary()


def view_poll_metrics(registry: CollectorRegistry = REGISTRY) -> ViewPollMetrics:
    """The view poll's histograms, registered once per registry."""
    metrics = _VIEW_POLL.get(registry)
    if metrics is None:
        metrics = ViewPollMetrics(
            Histogram(
                "kairos_dispatcher_view_poll_seconds",
                "One poll of the cluster view: SCAN (every few polls) and MGET of the heartbeats, and the "
                "membership rules over them",
                buckets=_POLL_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "kairos_dispatcher_view_oldest_heartbeat_seconds",
                "At each successful poll, just before its update: the age of the oldest heartbeat in the view "
                "(the view's worst staleness; with 100 ms beats and 50 ms polls, about 0.15 s when nothing lags)",
                buckets=_VIEW_AGE_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "kairos_dispatcher_view_poll_lateness_seconds",
                "How long after its slot each periodic poll began: the event loop busy with requests, or the "
                "host's CPUs with other processes",
                buckets=_POLL_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "kairos_dispatcher_view_read_seconds",
                "Each poll's SCAN (every few polls) and MGET of the heartbeats, on the poll thread: Redis and the "
                "round trips, apart from the dispatcher's event loop",
                buckets=_POLL_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "kairos_dispatcher_view_apply_wait_seconds",
                "How long each poll's read waited for the event loop (busy with requests, or the host's CPUs busy) "
                "before the update began",
                buckets=_POLL_BUCKETS,
                registry=registry,
            ),
            Histogram(
                "kairos_dispatcher_view_read_delay_seconds",
                "At each poll that read new heartbeats: the largest time from a heartbeat's sent_at (the node's "
                "clock) to its entry into the view (this dispatcher's clock), so it includes any offset between "
                "the two clocks; with 50 ms polls and nothing lagging, at most about 0.05 s",
                buckets=_READ_DELAY_BUCKETS,
                registry=registry,
            ),
        )
        _VIEW_POLL[registry] = metrics
    return metrics


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
            age.add_metric([node.node_id, Role.PREFILL], max(0.0, now - node.reported_at))
        for node in view.decode:
            age.add_metric([node.node_id, Role.DECODE], max(0.0, now - node.reported_at))
        yield age
        degraded = GaugeMetricFamily("kairos_dispatcher_degraded", "1 while Redis is unreachable (P/D routing only)")
        degraded.add_metric([], 1.0 if self.cluster.degraded else 0.0)
        yield degraded


class ClusterLike(Protocol):
    @property
    def degraded(self) -> bool: ...

    def view(self) -> ClusterView: ...

    def now(self) -> float: ...


class KvEventsReport(Protocol):
    """What :class:`PrefixIndexCollector` reads (``kairos.extproc.kv_events.KvEventConsumer``)."""

    @property
    def subscribers(self) -> Mapping[str, object]: ...

    def report(self, node_id: str) -> Mapping[str, Any] | None: ...


class PrefixIndexCollector:
    """Exports each subscribed node's KV event stream at scrape time: whether its hits count
    (connected, in step and fresh; else they read zero), its blocks indexed, and its resets."""

    def __init__(self, consumer: KvEventsReport) -> None:
        self.consumer = consumer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "kairos_dispatcher_kv_events_up",
            "1 while a node's KV event index counts in decisions (its stream connected, in step and fresh); "
            "0: its prefix hits read zero",
            labels=["node"],
        )
        blocks = GaugeMetricFamily(
            "kairos_dispatcher_prefix_index_blocks", "Prefix-cache blocks indexed per node", labels=["node"]
        )
        resets = CounterMetricFamily(
            "kairos_dispatcher_kv_events_resets",
            "Times a node's index was cleared: AllBlocksCleared, a restart, a lost connection, a hole no replay filled",
            labels=["node"],
        )
        for node_id in list(self.consumer.subscribers):
            report = self.consumer.report(node_id)
            if report is None:
                continue
            up.add_metric([node_id], 1.0 if report["fresh"] else 0.0)  # fresh: in step, and connected or recent
            blocks.add_metric([node_id], float(report["cached_blocks"]))
            resets.add_metric([node_id], float(report["resets"]))
        yield up
        yield blocks
        yield resets
