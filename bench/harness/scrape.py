"""Prometheus scrapes of a dispatcher's metrics: a histogram between two scrapes, counters,
decisions by route."""

from __future__ import annotations

import urllib.request
from typing import Any


def scrape_histogram(metrics_url: str, name: str) -> dict[str, float]:
    """``{"le=<bound>": cumulative count, ..., "sum": s, "count": n}`` of one unlabelled histogram."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[f"le={le}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum "):
            out["sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count "):
            out["count"] = float(line.rsplit(" ", 1)[1])
    return out


def scrape_counters(metrics_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Every sample of the metrics ``names``, keyed by its series (``name{labels}``)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        series: float(value)
        for series, _, value in (line.rpartition(" ") for line in text.splitlines())
        if series.split("{", 1)[0] in names
    }


def scrape_decisions(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kairos_dispatcher_decisions_total{")
    }


def histogram_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean and bucket-interpolated p50/p99 (ms) of the observations between two scrapes."""
    count = after.get("count", 0.0) - before.get("count", 0.0)
    if count <= 0:
        return {"count": 0}
    bounds = sorted(
        (float(k[3:]), after[k] - before.get(k, 0.0)) for k in after if k.startswith("le=") and k != "le=+Inf"
    )

    def quantile(q: float) -> tuple[float | None, str]:
        """(interpolated value, "(lo, hi] ms" bucket it falls in); None above the last bound."""
        rank = q * count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cum in bounds:
            if cum >= rank:
                span = cum - lower_count
                frac = (rank - lower_count) / span if span > 0 else 1.0
                value = (lower_bound + frac * (bound - lower_bound)) * 1e3
                return value, f"({lower_bound * 1e3:g}, {bound * 1e3:g}] ms"
            lower_bound, lower_count = bound, cum
        return None, f"> {lower_bound * 1e3:g} ms"

    p50, p50_bucket = quantile(0.50)
    p99, p99_bucket = quantile(0.99)
    return {
        "count": int(count),
        "mean_ms": (after["sum"] - before.get("sum", 0.0)) / count * 1e3,
        "p50_ms_from_buckets": p50,
        "p50_bucket": p50_bucket,
        "p99_ms_from_buckets": p99,
        "p99_bucket": p99_bucket,
        "buckets_le_s": {k[3:]: int(after[k] - before.get(k, 0.0)) for k in after if k.startswith("le=")},
    }
