"""Figures for ``kairos replay --plots DIR``, from its per-request records:

- ``ttft_cdf.png``: the TTFT distribution per route (and overall), with the TTFT SLO;
- ``latency_over_time.png``: each request's TTFT at its arrival time, deflections marked apart
  from keeps, failures on the axis;
- ``node_load.png``: requests in flight on each decode node over time (from send to the end of
  the response), the load the dispatcher spread;
- ``ttft_turns_cdf.png`` (conversations only): the TTFT distribution of first turns and of later
  turns, which resend the conversation so far, per route.

matplotlib is imported lazily with the Agg backend, as in :mod:`kairos.sim.plots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kairos.common.contracts.routes import Route
from kairos.sim.plots import DPI

ROUTE_STYLE: dict[str, dict[str, Any]] = {
    Route.KEEP: {"color": "#4e79a7", "marker": "o"},
    Route.DEFLECT: {"color": "#e15759", "marker": "^"},
    Route.SPLIT: {"color": "#59a14f", "marker": "s"},
    "": {"color": "#999999", "marker": "x"},
}


def _route_style(route: str) -> dict[str, Any]:
    return ROUTE_STYLE.get(route, ROUTE_STYLE[""])


def in_flight_steps(intervals: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(times, counts) of a step function: how many of ``intervals`` ([start, end)) hold at each
    change point. Ends sort before starts at the same instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    times, counts, now = [], [], 0
    for t, delta in events:
        now += delta
        times.append(t)
        counts.append(now)
    return np.asarray(times, dtype=float), np.asarray(counts, dtype=int)


def write_replay_plots(records: Sequence[dict[str, Any]], out_dir: Path, ttft_slo_s: float) -> list[Path]:
    """Write the three figures for ``records`` (``RequestResult.to_json`` dicts); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r["ok"] and r["ttft_s"] is not None]
    routes = sorted({r["route"] for r in ok})
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, group in [("all", ok), *((route or "none", [r for r in ok if r["route"] == route]) for route in routes)]:
        values = np.sort([r["ttft_s"] for r in group])
        if values.size:
            style = {"color": "#333333"} if name == "all" else {"color": _route_style(group[0]["route"])["color"]}
            fraction = np.arange(1, values.size + 1) / values.size
            ax.step(values, fraction, where="post", label=f"{name} (n={values.size})", **style)
    ax.axvline(ttft_slo_s, color="#555555", linestyle="--", linewidth=1.0, label=f"SLO {ttft_slo_s:g} s")
    ax.set(xlabel="TTFT (s, model time)", ylabel="fraction of requests", title="TTFT CDF by route", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    for route in routes:
        group = [r for r in ok if r["route"] == route]
        style = _route_style(route)
        ax.scatter(
            [r["arrival_s"] for r in group], [r["ttft_s"] for r in group], s=12, alpha=0.7,
            label=route or "none", color=style["color"], marker=style["marker"],
        )  # fmt: skip
    failed = [r for r in records if not r["ok"]]
    if failed:
        at = [r["arrival_s"] for r in failed]
        ax.scatter(at, [0.0] * len(at), s=30, color="black", marker="x", label="failed")
    ax.axhline(ttft_slo_s, color="#555555", linestyle="--", linewidth=1.0, label="TTFT SLO")
    ax.set(xlabel="arrival (s, model time)", ylabel="TTFT (s)", title="TTFT over time (deflections marked)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    paths.append(_save(fig, out_dir / "latency_over_time.png"))

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    done = [r for r in records if r["decode_node"] and r["e2e_s"] is not None]
    for node in sorted({r["decode_node"] for r in done}):
        spans = [
            (r["arrival_s"] + r["send_lag_ms"] / 1e3, r["arrival_s"] + r["send_lag_ms"] / 1e3 + r["e2e_s"])
            for r in done
            if r["decode_node"] == node
        ]
        times, counts = in_flight_steps(spans)
        ax.step(times, counts, where="post", label=node)
    ax.set(xlabel="time (s, model time)", ylabel="requests in flight", title="Load per decode node")
    ax.grid(alpha=0.3)
    if done:
        ax.legend(loc="upper left")
    paths.append(_save(fig, out_dir / "node_load.png"))

    if any(r.get("turn", 0) >= 2 for r in ok):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, first, style in (("turn 1", True, "-"), ("turns >= 2", False, "--")):
            for route in routes:
                values = np.sort([r["ttft_s"] for r in ok if r["route"] == route and (r.get("turn", 0) <= 1) == first])
                if values.size:
                    fraction = np.arange(1, values.size + 1) / values.size
                    ax.step(
                        values, fraction, where="post", linestyle=style, color=_route_style(route)["color"],
                        label=f"{label}, {route or 'none'} (n={values.size})",
                    )  # fmt: skip
        ax.axvline(ttft_slo_s, color="#555555", linestyle=":", linewidth=1.0, label=f"SLO {ttft_slo_s:g} s")
        ax.set(xlabel="TTFT (s, model time)", ylabel="fraction of requests", title="TTFT CDF: first and later turns")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        paths.append(_save(fig, out_dir / "ttft_turns_cdf.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
