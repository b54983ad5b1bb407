"""``kairos top``: a live terminal view of a Kairos cluster, from one dispatcher's ``/nodes`` and
``/metrics``, the decode nodes' sidecars' metrics (their addresses from ``/nodes``), and a
Prometheus's firing alerts when ``--prometheus`` names one.

Each refresh scrapes both, and the frame shows: the profile the dispatcher routes with; every
node with its role, batch (B), KV in use, queued and deflected prefill tokens, step calibration
(how much slower than its profile a decode node's steps run, flagged SLOW over
:data:`SLOW_STEP_CALIBRATION`) and heartbeat age; decisions per second by route and reason
(counter deltas between two scrapes, so the first frame has none); per path the mean predicted
TTFT and the mean of the sidecars' observed/predicted ratios since the dispatcher started, and
the live MAPE (the dispatcher's rolling window); by SLO class, the decisions, and over the last
frame the share of judged requests that met their own SLOs and the goodput (output tokens per
second of those that did), from the sidecars' counters; and the alerts. Without a
Prometheus the alert conditions that the dispatcher's own metrics show are checked here, now,
with the thresholds of compose/observability/kairos-rules.yml (a unit test keeps them equal)
but without their ``for`` durations.

The rendering (:func:`render`) is a pure function of two scrapes and the alerts, tested with
fixed inputs; :func:`run` is the loop around it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kairos.common.contracts import SIDECAR_METRICS_PATH, HeartbeatField
from kairos.common.contracts.routes import Route
from kairos.core.slo import DEFAULT_CLASSES

DEFAULT_DISPATCHER = "http://127.0.0.1:9100"  # the dispatcher's default --metrics-port
# The alert thresholds of compose/observability/kairos-rules.yml, for evaluating them locally.
STALE_HEARTBEAT_S = 1.0  # KairosNodeHeartbeatStale
TTFT_MAPE_LIMIT = 0.25  # KairosTtftPredictionDrift
# ... only with this many samples (the rule counts them over its last 10 min; one scrape can only
# count them since the dispatcher started): a window of a few samples is no drift.
TTFT_MIN_SAMPLES = 10
# A decode node whose step calibration (the p99 of its actual / predicted step times, from its
# heartbeat) is over this runs slower than its profile by more than a fitted profile's own error
# explains (a held-out MAPE of 10% gives about 1.3): a loaded host, or a profile of other hardware.
SLOW_STEP_CALIBRATION = 1.5
PATHS = tuple(route.value for route in Route)
# The sidecars' per-class SLO counters (kairos.nodeagent.sidecar.SidecarMetrics).
SLO_REQUESTS = "kairos_sidecar_slo_requests_total"
SLO_GOODPUT_TOKENS = "kairos_sidecar_slo_goodput_tokens_total"
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen

LabelSet = tuple[tuple[str, str], ...]
Metrics = dict[str, dict[LabelSet, float]]  # series name -> sorted labels -> value


def _series(metrics: Metrics, name: str, match: Mapping[str, str]) -> dict[LabelSet, float]:
    return {
        labels: value
        for labels, value in metrics.get(name, {}).items()
        if all(dict(labels).get(k) == v for k, v in match.items())
    }


@dataclass(frozen=True)
class Scrape:
    """One read of the dispatcher: ``/nodes`` as JSON and ``/metrics`` parsed; and of each decode
    node's sidecar that answered, its metrics parsed, by node id."""

    at: float  # monotonic seconds
    nodes: Mapping[str, Any]
    metrics: Metrics
    sidecars: Mapping[str, Metrics] = field(default_factory=dict)

    def series(self, name: str, **match: str) -> dict[LabelSet, float]:
        return _series(self.metrics, name, match)

    def total(self, name: str, **match: str) -> float:
        return sum(self.series(name, **match).values())

    def sidecar_total(self, name: str, **match: str) -> float:
        return sum(sum(_series(m, name, match).values()) for m in self.sidecars.values())


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    summary: str
    state: str = "firing"  # or "pending" (Prometheus only)


@dataclass
class Frame:
    """Everything one screen shows."""

    source: str
    clock: str  # wall time of the scrape, HH:MM:SS
    interval_s: float
    scrape: Scrape | None
    previous: Scrape | None
    alerts: list[Alert] | None  # None: unknown (Prometheus unreachable)
    alerts_from: str  # "prometheus URL" or "local"
    errors: list[str] = field(default_factory=list)


def parse_metrics(text: str) -> Metrics:
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


# ---------------------------------------------------------------------------------------------
# Alerts
# ---------------------------------------------------------------------------------------------
def local_alerts(scrape: Scrape) -> list[Alert]:
    """The rules' conditions that the dispatcher's metrics show, as they hold now."""
    alerts = []
    for labels, age in sorted(scrape.series("kairos_dispatcher_heartbeat_age_seconds").items()):
        lab = dict(labels)
        if age > STALE_HEARTBEAT_S:
            alerts.append(
                Alert(
                    "KairosNodeHeartbeatStale",
                    "warning",
                    f"{lab.get('role')} node {lab.get('node')}: last heartbeat {age:.1f} s ago",
                )
            )
    if scrape.total("kairos_dispatcher_degraded") >= 1:
        alerts.append(Alert("KairosDispatcherDegraded", "critical", "dispatcher cannot reach Redis"))
    for labels, mape in sorted(scrape.series("kairos_dispatcher_ttft_prediction_mape").items()):
        path = dict(labels).get("path", "")
        samples = scrape.total("kairos_dispatcher_ttft_observed_over_predicted_count", path=path)
        if mape > TTFT_MAPE_LIMIT and samples >= TTFT_MIN_SAMPLES:
            alerts.append(
                Alert(
                    "KairosTtftPredictionDrift",
                    "warning",
                    f"{dict(labels).get('path')} TTFT predictions off by {mape:.0%} (MAPE)",
                )
            )
    return alerts


def prometheus_alerts(payload: Mapping[str, Any]) -> list[Alert]:
    """Prometheus's ``GET /api/v1/alerts`` answer as alerts, firing first."""
    alerts = [
        Alert(
            a["labels"].get("alertname", "?"),
            a["labels"].get("severity", ""),
            a.get("annotations", {}).get("summary", ""),
            a.get("state", "firing"),
        )
        for a in payload["data"]["alerts"]
    ]
    return sorted(alerts, key=lambda a: (a.state != "firing", a.name, a.summary))


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def _rate(frame: Frame, name: str, **match: str) -> float | None:
    cur, prev = frame.scrape, frame.previous
    if cur is None or prev is None or cur.at <= prev.at:
        return None
    return max(0.0, cur.total(name, **match) - prev.total(name, **match)) / (cur.at - prev.at)


def _sidecar_increase(frame: Frame, name: str, **match: str) -> float | None:
    """How much a sidecar counter grew over the last frame, summed over the sidecars read both
    times (one that restarted counts from zero); None without two reads of any sidecar."""
    cur, prev = frame.scrape, frame.previous
    if cur is None or prev is None or cur.at <= prev.at:
        return None
    both = [(m, prev.sidecars[node]) for node, m in cur.sidecars.items() if node in prev.sidecars]
    if not both:
        return None
    increase = 0.0
    for now, before in both:
        a, b = sum(_series(now, name, match).values()), sum(_series(before, name, match).values())
        increase += a - b if a >= b else a
    return increase


def _mean(scrape: Scrape, name: str, **match: str) -> float | None:
    """Mean of a histogram's observations since the dispatcher started."""
    count = scrape.total(f"{name}_count", **match)
    return scrape.total(f"{name}_sum", **match) / count if count > 0 else None


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit


def slow_nodes(nodes: list[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """(id, step calibration) of every node running slower than its profile (over the line)."""
    out = []
    for node in nodes:
        calibration = node.get(HeartbeatField.STEP_CALIBRATION)
        if calibration is not None and calibration > SLOW_STEP_CALIBRATION:
            out.append((str(node["id"]), float(calibration)))
    return out


def _node_rows(nodes: list[Mapping[str, Any]]) -> list[str]:
    f = HeartbeatField
    rows = [
        f"{'NODE':<10} {'ROLE':<8} {'BATCH':>5} {'KV IN USE':>20} {'QUEUED PREFILL':>14} {'DEFLECTED':>9} "
        f"{'STEP/PROFILE':>12} {'HEARTBEAT':>9}"
    ]
    slow = dict(slow_nodes(nodes))
    for node in nodes:
        kv = "-"
        if f.KV_TOKENS in node:
            cap = node.get(f.KV_CAPACITY_TOKENS) or 0
            kv = f"{node[f.KV_TOKENS]}/{cap}" + (f" ({node[f.KV_TOKENS] / cap:.0%})" if cap else "")
        calibration = node.get(f.STEP_CALIBRATION)
        flags = " STALE" if node.get("stale") else ""
        flags += "" if node.get("from_redis", True) else " STATIC"
        flags += " SLOW" if node["id"] in slow else ""
        rows.append(
            f"{node['id']:<10} {node['role']:<8} {node.get(f.DECODE_TOKENS, '-'):>5} {kv:>20} "
            f"{node.get(f.QUEUED_PREFILL_TOKENS, '-'):>14} {node.get(f.SCHEDULED_PREFILL_TOKENS, '-'):>9} "
            f"{'-' if calibration is None else f'x{calibration:.2f}':>12} {node['age_s']:>7.2f} s{flags}"
        )
    if not nodes:
        rows.append("(no nodes in the dispatcher's view)")
    for node_id, calibration in slow.items():
        rows += [
            f"SLOW {node_id}: steps up to {calibration:.2f}x its profile's (p99): a loaded host, or a profile of "
            "other hardware",
            f"     its chunks are planned to the step budget / {calibration:.2f}; deflect TTFT predictions there "
            "are not scaled",
        ]
    return rows


def _admission_line(frame: Frame, scrape: Scrape) -> str:
    """Admission control (kairos.core.admission): what the cluster holds against its budget, the
    requests waiting for a seat, and the 429s (kairos_dispatcher_shed_total) by reason."""
    budget = scrape.total("kairos_dispatcher_admission_budget")
    held = scrape.total("kairos_dispatcher_admission_in_flight")
    waiting = scrape.total("kairos_dispatcher_admission_waiting")
    # The gauges are set at each admission check: none yet, or --admission off.
    load = f"in flight {held:.0f}/{budget:.0f} ({held / budget:.0%})" if budget else "in flight - (no check yet)"
    shed = scrape.total("kairos_dispatcher_shed_total")
    reasons = ", ".join(
        f"{dict(labels)['reason']} {count:.0f}"
        for labels, count in sorted(scrape.series("kairos_dispatcher_shed_total").items())
        if count
    )
    return (
        f"ADMISSION  {load}, {waiting:.0f} waiting   shed (429) "
        f"{_num(_rate(frame, 'kairos_dispatcher_shed_total'), '.1f', '/s')}, {shed:.0f} total"
        + (f" ({reasons})" if reasons else "")
    )


def _class_lines(frame: Frame, scrape: Scrape) -> list[str]:
    """By SLO class (tightest first, as kairos.core.slo's defaults order them): the decisions
    (kairos_dispatcher_class_decisions_total{class,route}), each class's total and its routes;
    and over the last frame, from the sidecars' counters, the share of the requests judged that
    met their own SLOs (met / (met + missed)) and the goodput (output tokens per second of those)."""
    decisions: dict[str, dict[str, float]] = {}
    for labels, count in sorted(scrape.series("kairos_dispatcher_class_decisions_total").items()):
        named = dict(labels)
        decisions.setdefault(named["class"], {})[named["route"]] = count
    judged = {dict(labels)["class"] for m in scrape.sidecars.values() for labels in m.get(SLO_REQUESTS, {})}
    order = {k.name: i for i, k in enumerate(DEFAULT_CLASSES)}
    names = [
        name
        for name in sorted(set(decisions) | judged, key=lambda n: (order.get(n, len(order)), n))
        if sum(decisions.get(name, {}).values()) or scrape.sidecar_total(SLO_REQUESTS, **{"class": name})
    ]
    if not names:
        return ["BY CLASS   (no decisions yet)"]
    cur, prev = frame.scrape, frame.previous
    span = cur.at - prev.at if cur is not None and prev is not None and cur.at > prev.at else None
    lines = [f"{'BY CLASS':<14} {'decisions':<32} {'SLO met':>16} {'goodput':>14}"]
    for name in names:
        routes = decisions.get(name, {})
        total = sum(routes.values())
        decided = f"{total:.0f} ({', '.join(f'{r} {n:.0f}' for r, n in sorted(routes.items()) if n)})" if total else "0"
        met = _sidecar_increase(frame, SLO_REQUESTS, **{"class": name, "outcome": "met"})
        missed = _sidecar_increase(frame, SLO_REQUESTS, **{"class": name, "outcome": "missed"})
        judged_now = None if met is None or missed is None else met + missed
        attained = f"{met / judged_now:.1%} of {judged_now:.0f}" if met is not None and judged_now else "-"
        tokens = _sidecar_increase(frame, SLO_GOODPUT_TOKENS, **{"class": name})
        goodput = _num(None if tokens is None or span is None else tokens / span, ".1f", " tok/s")
        lines.append(f"  {name:<12} {decided:<32} {attained:>16} {goodput:>14}")
    return lines


def render(frame: Frame) -> str:
    """The screen for one frame, as text."""
    lines = [f"kairos top  {frame.source}  {frame.clock}  refresh {frame.interval_s:g} s"]
    lines += [f"! {error}" for error in frame.errors]
    scrape = frame.scrape
    if scrape is None:
        return "\n".join(lines) + "\n"
    status = scrape.nodes.get("status", "?")
    fallback = "  (static node lists: Redis never answered)" if scrape.nodes.get("static_fallback") else ""
    lines.append(f"status {status}{fallback}")
    for labels in scrape.series("kairos_dispatcher_profile_info"):
        lines.append(f"profile {dict(labels).get('name')} ({dict(labels).get('source')})")
    lines.append("")
    lines += _node_rows(list(scrape.nodes.get("nodes", [])))

    lines.append("")
    total = _rate(frame, "kairos_dispatcher_decisions_total")
    share = ""
    for route, word in ((Route.DEFLECT, "deflected"), (Route.SPLIT, Route.SPLIT.value)):
        rate = _rate(frame, "kairos_dispatcher_decisions_total", route=route)
        share += f", {rate / total:.0%} {word}" if total and rate is not None else ""
    latency = _mean(scrape, "kairos_dispatcher_decision_seconds")
    latency_ms = None if latency is None else latency * 1e3
    lines.append(f"DECISIONS  {_num(total, '.1f', '/s')}{share}   mean decision time {_num(latency_ms, '.2f', ' ms')}")
    k_share = _mean(scrape, "kairos_dispatcher_split_prefill_share")
    if k_share is not None:
        share = f"{k_share:.0%} of the prompt on average (k)"
        lines.append(f"  splits: the prefill node computes {share}, the decode node the rest")
    keys = sorted(
        {dict(k)["route"] + " " + dict(k)["reason"] for k in scrape.series("kairos_dispatcher_decisions_total")}
    )
    for key in keys:
        route, reason = key.split(" ", 1)
        rate = _rate(frame, "kairos_dispatcher_decisions_total", route=route, reason=reason)
        count = scrape.total("kairos_dispatcher_decisions_total", route=route, reason=reason)
        lines.append(f"  {route:<8} {reason:<36} {_num(rate, '.2f', '/s'):>10} {count:>8.0f} total")
    if not keys:
        lines.append("  (no decisions yet)")
    lines += _class_lines(frame, scrape)
    lines.append(_admission_line(frame, scrape))

    lines.append("")
    lines.append(f"{'TTFT':<10} {'predicted mean':>14} {'observed/predicted':>18} {'live MAPE':>10} {'samples':>8}")
    for path in PATHS:
        predicted = _mean(scrape, "kairos_dispatcher_predicted_ttft_seconds", route=path)
        ratio = _mean(scrape, "kairos_dispatcher_ttft_observed_over_predicted", path=path)
        mape = scrape.series("kairos_dispatcher_ttft_prediction_mape", path=path)
        samples = scrape.total("kairos_dispatcher_ttft_observed_over_predicted_count", path=path)
        lines.append(
            f"  {path:<8} {_num(predicted, '.3f', ' s'):>14} {_num(ratio, '.2f'):>18} "
            f"{_num(max(mape.values()) if mape else None, '.1%'):>10} {samples:>8.0f}"
        )

    lines.append("")
    if frame.alerts is None:
        lines.append(f"ALERTS ({frame.alerts_from}): unknown")
    else:
        firing = sum(a.state == "firing" for a in frame.alerts)
        lines.append(f"ALERTS ({frame.alerts_from}): {firing} firing")
        for alert in frame.alerts:
            lines.append(f"  {alert.state.upper():<7} {alert.severity:<8} {alert.name:<28} {alert.summary}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read()


def _read_sidecars(
    nodes: Mapping[str, Any], timeout_s: float, fetch: Callable[[str, float], bytes], errors: list[str]
) -> dict[str, Metrics]:
    """The metrics of each decode node's sidecar that ``/nodes`` names, by node id; one that does
    not answer is left out (and said in ``errors``): its class figures miss its requests."""
    out: dict[str, Metrics] = {}
    for node in nodes.get("nodes", []):
        sidecar = node.get(HeartbeatField.SIDECAR)
        if node.get("role") != "decode" or not sidecar:
            continue
        try:
            out[str(node["id"])] = parse_metrics(fetch(f"http://{sidecar}{SIDECAR_METRICS_PATH}", timeout_s).decode())
        except (OSError, ValueError) as exc:
            errors.append(f"sidecar of {node['id']} {sidecar}: {exc}")
    return out


def next_frame(args: argparse.Namespace, previous: Scrape | None, fetch: Callable[[str, float], bytes] = _get) -> Frame:
    base = args.dispatcher.rstrip("/")
    frame = Frame(
        base,
        time.strftime("%H:%M:%S"),
        args.interval,
        None,
        previous,
        None,
        f"prometheus {args.prometheus}" if args.prometheus else "local",
    )
    try:
        nodes = json.loads(fetch(f"{base}/nodes", args.timeout))
        metrics = parse_metrics(fetch(f"{base}/metrics", args.timeout).decode())
        at = time.monotonic()
        frame.scrape = Scrape(at, nodes, metrics, _read_sidecars(nodes, args.timeout, fetch, frame.errors))
    except (OSError, ValueError) as exc:  # unreachable, refused, HTTP error, not JSON
        frame.errors.append(f"dispatcher {base}: {exc}")
        frame.previous = None
    if args.prometheus:
        try:
            frame.alerts = prometheus_alerts(
                json.loads(fetch(f"{args.prometheus.rstrip('/')}/api/v1/alerts", args.timeout))
            )
        except (OSError, ValueError, KeyError) as exc:
            frame.errors.append(f"prometheus {args.prometheus}: {exc}")
    elif frame.scrape is not None:
        frame.alerts = local_alerts(frame.scrape)
    return frame


def run(args: argparse.Namespace) -> int:
    previous: Scrape | None = None
    shown = 0
    try:
        while True:
            frame = next_frame(args, previous)
            sys.stdout.write(("" if args.plain else CLEAR) + render(frame))
            sys.stdout.flush()
            shown += 1
            previous = frame.scrape
            if args.iterations and shown >= args.iterations:
                return 0 if frame.scrape is not None else 1
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="live terminal view of a running cluster (nodes, decisions, TTFT, alerts)",
        description="Refresh a view of the cluster from one dispatcher's /nodes and /metrics, and "
        "the decode nodes' sidecars' metrics for each SLO class's attainment and goodput (kairos up "
        "prints the command). Alerts come from --prometheus when given, else the "
        "rules' conditions are checked here from the dispatcher's metrics.",
    )
    p.add_argument(
        "--dispatcher", default=DEFAULT_DISPATCHER, help=f"the dispatcher's metrics URL (default {DEFAULT_DISPATCHER})"
    )
    p.add_argument("--prometheus", help="Prometheus URL to show its alerts, e.g. http://127.0.0.1:9090")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many frames (default: until Ctrl-C)")
    p.add_argument("--plain", action="store_true", help="print frames one after another (no screen clearing)")
    p.set_defaults(handler=run)
