"""The dashboard and rules in compose/observability, read as the tests need them: every PromQL
query (Grafana's variables replaced by what Prometheus understands) and the metric names in it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
OBSERVABILITY = ROOT / "compose" / "observability"
DASHBOARD = OBSERVABILITY / "kairos-dashboard.json"
RULES = OBSERVABILITY / "kairos-rules.yml"
RULES_TEST = OBSERVABILITY / "kairos-rules.test.yml"
PROMETHEUS_CONFIG = OBSERVABILITY / "prometheus.yml"

# Grafana's range variables, as a Prometheus scraping every second can evaluate them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
_METRIC = re.compile(r"\b(?:kairos_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
_RECORDED = re.compile(r"\bkairos:[a-z0-9_:]+")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(board: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """``(panel title / refId, PromQL)`` of every target of every panel."""
    out = []
    for panel in (board or dashboard())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append((f"{panel['title']} / {target['refId']}", expr))
    return out


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The exported metric names an expression reads (recording rules' names excluded)."""
    return set(_METRIC.findall(expr))


def recorded_names(expr: str) -> set[str]:
    return set(_RECORDED.findall(expr))
