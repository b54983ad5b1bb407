"""Figures and a terminal table for `kairos sim` result records.

Each record is a plain dict for one (policy, request rate) run, with the keys that
`kairos.sim.metrics.summarize` produces plus ``policy``, ``policy_spec``, ``rps``, ``workload``,
``tbt_slo_ms`` and ``ttft_slo_s``. The figures follow the paper: Figure 4 (P95 TTFT / TBT vs
RPS), Figure 5 (throughput), Figure 6 (SLO attainment and deflections), Table 3 (P95 TTFT
breakdown, drawn as stacked bars) and, for a single-rate comparison, Figure 2 / Table 4.

matplotlib is imported lazily and the Agg backend is selected inside :func:`write_plots`, so
importing this module never touches a display or changes the backend for other modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 120
#: Above this many distinct rates the TTFT breakdown shows only the highest one.
BREAKDOWN_MAX_RATES = 3
#: (record key, legend label, colour) for the stacked P95 TTFT breakdown, bottom to top.
BREAKDOWN_PARTS: tuple[tuple[str, str, str], ...] = (
    ("p95_prefill_queue_s", "Prefill queue", "#4e79a7"),
    ("p95_prefill_exec_s", "Prefill exec", "#f28e2b"),
    ("p95_kv_transfer_s", "KV transfer", "#59a14f"),
    ("p95_decode_queue_s", "Decode queue", "#b07aa1"),
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
_SLO_STYLE: dict[str, Any] = {"color": "#555555", "linestyle": "--", "linewidth": 1.2}


@dataclass(frozen=True)
class _Panel:
    """One line-plot panel: a value per record, drawn against RPS for each policy."""

    title: str
    ylabel: str
    value: Callable[[dict[str, Any]], float | None]
    slo_key: str | None = None
    percent: bool = False
    only_deflecting: bool = False


def _num(rec: dict[str, Any], key: str) -> float | None:
    """The record's value for key as a float, or None when absent, None, non-numeric or NaN."""
    v = rec.get(key)
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _key(key: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def get(rec: dict[str, Any]) -> float | None:
        v = _num(rec, key)
        return None if v is None else v * scale

    return get


def _policy_order(records: Sequence[dict[str, Any]]) -> list[str]:
    """Policy labels in order of first appearance."""
    seen: dict[str, None] = {}
    for rec in records:
        seen.setdefault(str(rec.get("policy", "?")), None)
    return list(seen)


def _by_policy(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by policy (first-appearance order), each group sorted by rps."""
    groups: dict[str, list[dict[str, Any]]] = {p: [] for p in _policy_order(records)}
    for rec in records:
        groups[str(rec.get("policy", "?"))].append(rec)
    for recs in groups.values():
        recs.sort(key=lambda r: (_num(r, "rps") is None, _num(r, "rps") or 0.0))
    return groups


def _rates(records: Sequence[dict[str, Any]]) -> list[float]:
    return sorted({v for r in records if (v := _num(r, "rps")) is not None})


def _slo_values(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    return sorted({v for r in records if (v := _num(r, key)) is not None})


def policy_colors(policies: Sequence[str]) -> dict[str, str]:
    """A fixed colour per policy, by order of first appearance (tab10, or tab20 beyond ten policies)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps["tab10" if len(policies) <= 10 else "tab20"]
    return {p: to_hex(cmap(i % cmap.N)) for i, p in enumerate(policies)}


def _fmt_rate(rps: float) -> str:
    return f"{rps:g}"


def _subtitle(records: Sequence[dict[str, Any]]) -> str:
    workloads = sorted({str(r["workload"]) for r in records if r.get("workload") is not None})
    return f" — {', '.join(workloads)}" if workloads else ""


def _figure(
    ncols: int, nrows: int = 1, width: float = 5.6, height: float = 4.2, sharey: bool = False
) -> tuple[Figure, list[Axes]]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, sharey=sharey)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return path


def _shared_legend(fig: Figure, axes: Sequence[Axes], first: Sequence[str] = ()) -> None:
    """One legend below all panels, so it never covers data; labels in ``first`` lead, in that order."""
    found: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            found.setdefault(lab, h)
    if not found:
        return
    labels = [lab for lab in first if lab in found] + [lab for lab in found if lab not in first]
    handles = [found[lab] for lab in labels]
    # Legend entries at fontsize 9 take ~5.5 pt per character plus ~40 pt of handle and padding.
    width_pt = fig.get_figwidth() * 72
    per_entry = max(len(lab) for lab in labels) * 5.5 + 40
    ncol = max(1, min(len(labels), int(width_pt // per_entry)))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False, fontsize=9)


def _set_rate_ticks(ax: Axes, rates: Sequence[float]) -> None:
    if 0 < len(rates) <= 15:
        ax.set_xticks(list(rates))
        ax.set_xticklabels([_fmt_rate(r) for r in rates])


def _draw_slo(ax: Axes, values: Sequence[float], unit: str, label_in_legend: bool) -> None:
    for i, v in enumerate(values):
        ax.axhline(v, label="SLO" if (label_in_legend and i == 0) else None, zorder=1, **_SLO_STYLE)
        ax.annotate(
            f"SLO {v:g} {unit}",
            xy=(0.01, v),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
            color=_SLO_STYLE["color"],
            va="bottom",
        )


def _line_figure(
    records: Sequence[dict[str, Any]],
    panels: Sequence[_Panel],
    colors: dict[str, str],
    title: str,
    path: Path,
) -> Path | None:
    """Draw each panel that has data as value-vs-RPS lines per policy; None when no panel has data."""
    groups = _by_policy(records)
    rates = _rates(records)
    drawable: list[tuple[_Panel, dict[str, list[tuple[float, float]]]]] = []
    for panel in panels:
        series: dict[str, list[tuple[float, float]]] = {}
        for policy, recs in groups.items():
            if panel.only_deflecting and not any((_num(r, "deflections") or 0) > 0 for r in recs):
                continue
            pts = [(x, y) for r in recs if (x := _num(r, "rps")) is not None and (y := panel.value(r)) is not None]
            if pts:
                series[policy] = pts
        if series:
            drawable.append((panel, series))
    if not drawable:
        return None

    fig, axes = _figure(len(drawable))
    order = list(groups)
    for ax, (panel, series) in zip(axes, drawable, strict=True):
        for policy, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs,
                ys,
                marker=_MARKERS[order.index(policy) % len(_MARKERS)],
                color=colors[policy],
                label=policy,
                linewidth=1.8,
                markersize=6,
                zorder=3,
            )
        top = max(y for pts in series.values() for _, y in pts)
        if panel.slo_key is not None:
            unit = "s" if panel.slo_key.endswith("_s") else "ms"
            slos = _slo_values(records, panel.slo_key)
            _draw_slo(ax, slos, unit, label_in_legend=True)
            top = max([top, *slos])
        if panel.percent:
            lo = min(y for pts in series.values() for _, y in pts)
            ax.set_ylim(max(0.0, min(lo, 100.0) - 5.0), 102.0)
        else:
            positive = [y for pts in series.values() for _, y in pts if y > 0]
            if positive and top / min(positive) > 50:
                # An overloaded policy's queue blows up by orders of magnitude: a log axis keeps
                # the others (and the SLO line) readable.
                ax.set_yscale("log")
                ax.set_ylim(min(positive) * 0.8, top * 1.5)
            else:
                ax.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)
        if len(rates) == 1:
            ax.set_xlim(rates[0] - 1.0, rates[0] + 1.0)
        _set_rate_ticks(ax, rates)
        ax.set_title(panel.title)
        ax.set_xlabel("Request rate (RPS)")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
    if len(drawable) < len(panels):
        title = f"{drawable[0][0].title} vs request rate"
    fig.suptitle(title + _subtitle(records))
    fig.tight_layout()
    _shared_legend(fig, axes)
    return _save(fig, path)


def _bar_axis(ax: Axes, labels: Sequence[str]) -> None:
    """Category ticks (slanted when long), a minimum of three bar slots so one bar stays narrow, y grid."""
    ax.set_xticks(range(len(labels)))
    slant = max((len(lab) for lab in labels), default=0) > 8
    ax.set_xticklabels(labels, rotation=30 if slant else 0, ha="right" if slant else "center", fontsize=9)
    pad = max(0.0, (3 - len(labels)) / 2)
    ax.set_xlim(-0.5 - pad, len(labels) - 0.5 + pad)
    ax.grid(True, axis="y", alpha=0.3)


def _stacked_bars(ax: Axes, recs: Sequence[dict[str, Any]], labels: Sequence[str], label_parts: bool) -> float:
    """Draw one panel of stacked P95 components, one bar per record; returns the tallest value drawn."""
    xs = list(range(len(recs)))
    bottoms = [0.0] * len(recs)
    for key, name, color in BREAKDOWN_PARTS:
        vals = [_num(r, key) or 0.0 for r in recs]
        ax.bar(xs, vals, bottom=bottoms, color=color, label=name if label_parts else None, width=0.65, zorder=3)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    keep = [(x, v) for x, r in zip(xs, recs, strict=True) if (v := _num(r, "p95_ttft_keep_s")) is not None]
    if keep:
        kx, ky = zip(*keep, strict=True)
        ax.scatter(
            kx,
            ky,
            marker="_",
            s=600,
            linewidths=2.5,
            color="black",
            zorder=4,
            label="End-to-end P95 TTFT" if label_parts else None,
        )
    _bar_axis(ax, labels)
    return max([*bottoms, *(v for _, v in keep)], default=0.0)


def _breakdown_figure(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Stacked P95 TTFT components, in the style of the paper's Table 3.

    One bar per policy in a panel per rate (only the highest rate when there are many); with a single
    policy, one panel with a bar per rate instead.
    """
    with_parts = [r for r in records if any(_num(r, k) is not None for k, _, _ in BREAKDOWN_PARTS)]
    if not with_parts:
        return None
    rates = _rates(with_parts)
    order = _policy_order(with_parts)
    panels: list[tuple[str, list[dict[str, Any]], list[str]]] = []
    if len(order) == 1 and len(rates) > 1:
        recs = _by_policy(with_parts)[order[0]]
        panels.append((order[0], recs, [f"{_fmt_rate(_num(r, 'rps') or 0.0)} RPS" for r in recs]))
    elif not rates:
        panels.append(("all runs", list(with_parts), [str(r.get("policy", "?")) for r in with_parts]))
    else:
        shown = rates if len(rates) <= BREAKDOWN_MAX_RATES else rates[-1:]
        for rate in shown:
            recs = [r for r in with_parts if _num(r, "rps") == rate]
            recs.sort(key=lambda r: order.index(str(r.get("policy", "?"))))
            title = f"{_fmt_rate(rate)} RPS" + (" (highest rate)" if len(shown) < len(rates) else "")
            panels.append((title, recs, [str(r.get("policy", "?")) for r in recs]))
    nbars = max(len(recs) for _, recs, _ in panels)
    fig, axes = _figure(len(panels), width=max(5.0, 1.2 + 1.0 * nbars), height=4.6, sharey=True)
    top = 0.0
    for i, (ax, (title, recs, labels)) in enumerate(zip(axes, panels, strict=True)):
        top = max(top, _stacked_bars(ax, recs, labels, label_parts=i == 0))
        ax.set_title(title)
    axes[0].set_ylabel("P95 latency (s)")
    axes[0].set_ylim(0.0, top * 1.08 if top > 0 else 1.0)  # y is shared across panels
    fig.suptitle("P95 TTFT breakdown, non-deflected requests" + _subtitle(records))
    fig.tight_layout()
    _shared_legend(fig, axes, first=[name for _, name, _ in BREAKDOWN_PARTS])
    return _save(fig, path)


def _policy_bars_figure(records: Sequence[dict[str, Any]], colors: dict[str, str], path: Path) -> Path | None:
    """Single-rate comparison of policies (paper Figure 2 / Table 4)."""
    from matplotlib.ticker import MaxNLocator

    order = _policy_order(records)
    by_policy = {p: next(r for r in records if str(r.get("policy", "?")) == p) for p in order}
    tbt_slos = _slo_values(records, "tbt_slo_ms")
    tbt_slo = f"{tbt_slos[0]:g} ms" if len(tbt_slos) == 1 else "TBT SLO"
    metrics: list[tuple[str, str, Callable[[dict[str, Any]], float | None], str]] = [
        ("P95 TTFT", "P95 TTFT (s)", _key("p95_ttft_s"), "{:.2f}"),
        ("TBT violations", f"% of decode steps > {tbt_slo}", _key("tbt_violation_rate", 100.0), "{:.2f}"),
        ("SLO attainment", "% of requests meeting both SLOs", _key("slo_attainment", 100.0), "{:.1f}"),
        ("Deflections", "requests deflected", _key("deflections"), "{:.0f}"),
    ]
    drawable = [(m, [(p, v) for p in order if (v := m[2](by_policy[p])) is not None]) for m in metrics]
    drawable = [(m, vals) for m, vals in drawable if vals]
    if not drawable:
        return None
    ncols = 2 if len(drawable) > 1 else 1
    nrows = math.ceil(len(drawable) / ncols)
    fig, axes = _figure(ncols, nrows, width=max(4.8, 1.2 + 0.8 * len(order)), height=4.2)
    for ax, ((name, ylabel, _, fmt), vals) in zip(axes, drawable, strict=False):
        labels = [p for p, _ in vals]
        heights = [v for _, v in vals]
        bars = ax.bar(range(len(vals)), heights, color=[colors[p] for p in labels], width=0.65, zorder=3)
        ax.bar_label(bars, labels=[fmt.format(h) for h in heights], padding=2, fontsize=8)
        if name == "P95 TTFT":
            _draw_slo(ax, _slo_values(records, "ttft_slo_s"), "s", label_in_legend=False)
        _bar_axis(ax, labels)
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        top = max(heights) if heights else 0.0
        if name == "P95 TTFT":
            top = max([top, *_slo_values(records, "ttft_slo_s")])
        if name == "SLO attainment":
            ax.set_ylim(0.0, 112.0)
        else:
            ax.set_ylim(0.0, top * 1.15 if top > 0 else 1.0)
        if name == "Deflections":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[len(drawable) :]:
        ax.set_visible(False)
    rates = _rates(records)
    at = f" at {_fmt_rate(rates[0])} RPS" if rates else ""
    fig.suptitle("Deflection policy comparison" + at + _subtitle(records))
    fig.tight_layout()
    return _save(fig, path)


def write_plots(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Render the result figures for ``records`` as PNGs under ``out_dir`` and return their paths.

    Figures whose data are entirely missing from the records are skipped; panels are dropped
    individually when only their keys are missing. Raises ValueError for an empty record list.
    """
    if not records:
        raise ValueError("write_plots needs at least one result record")
    import matplotlib

    matplotlib.use("Agg")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = policy_colors(_policy_order(records))
    written: list[Path | None] = [
        _line_figure(
            records,
            [
                _Panel("P95 TTFT", "P95 TTFT (s)", _key("p95_ttft_s"), slo_key="ttft_slo_s"),
                _Panel("P95 TBT", "P95 TBT (ms)", _key("p95_tbt_ms"), slo_key="tbt_slo_ms"),
            ],
            colors,
            "P95 TTFT and TBT vs request rate",
            out_dir / "fig4_ttft_tbt.png",
        ),
        _line_figure(
            records,
            [
                _Panel("Output token throughput", "Output tokens/s", _key("output_tokens_per_s")),
                _Panel("Total token throughput", "Total (prompt + output) tokens/s", _key("total_tokens_per_s")),
            ],
            colors,
            "Throughput vs request rate",
            out_dir / "fig5_throughput.png",
        ),
        _line_figure(
            records,
            [
                _Panel(
                    "Joint SLO attainment",
                    "Requests meeting TTFT and TBT SLOs (%)",
                    _key("slo_attainment", 100.0),
                    percent=True,
                ),
                _Panel("Deflections", "Requests deflected to decode", _key("deflections"), only_deflecting=True),
            ],
            colors,
            "SLO attainment and deflections vs request rate",
            out_dir / "fig6_attainment_deflections.png",
        ),
        _breakdown_figure(records, out_dir / "ttft_breakdown.png"),
    ]
    if any((_num(r, "p95_ttft_turn2plus_s") or 0) > 0 for r in records):  # conversations: prefix caching
        written.append(
            _line_figure(
                records,
                [
                    _Panel("P95 TTFT, turns >= 2", "P95 TTFT (s)", _key("p95_ttft_turn2plus_s"), slo_key="ttft_slo_s"),
                    _Panel(
                        "Prefix hits on decode nodes",
                        "Prompt tokens a decode node had cached (%)",
                        _key("prefix_hit_rate_decode", 100.0),
                        percent=True,
                    ),
                ],
                colors,
                "Later turns and prefix hits vs request rate",
                out_dir / "prefix_turns.png",
            )
        )
    if len(_rates(records)) == 1:
        written.append(_policy_bars_figure(records, colors, out_dir / "fig2_policies.png"))
    return [p for p in written if p is not None]


def _cell(rec: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    v = _num(rec, key)
    return "-" if v is None else fmt.format(v * scale)


def format_table(records: list[dict[str, Any]]) -> str:
    """A fixed-width text table, one row per record, ordered by policy first appearance then rps."""
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("rps", lambda r: _cell(r, "rps", "{:.2f}")),
        ("p50_ttft_s", lambda r: _cell(r, "p50_ttft_s", "{:.3f}")),
        ("p95_ttft_s", lambda r: _cell(r, "p95_ttft_s", "{:.3f}")),
        ("p99_ttft_s", lambda r: _cell(r, "p99_ttft_s", "{:.3f}")),
        ("p95_tbt_ms", lambda r: _cell(r, "p95_tbt_ms", "{:.1f}")),
        ("tbt_viol_%", lambda r: _cell(r, "tbt_violation_rate", "{:.2f}", 100.0)),
        ("slo_attain_%", lambda r: _cell(r, "slo_attainment", "{:.1f}", 100.0)),
        ("deflections", lambda r: _cell(r, "deflections", "{:.0f}")),
        ("out_tok/s", lambda r: _cell(r, "output_tokens_per_s", "{:.1f}")),
    ]
    rows = [rec for recs in _by_policy(records).values() for rec in recs]
    body = [[str(r.get("policy", "?"))] + [fn(r) for _, fn in columns] for r in rows]
    header = ["policy"] + [name for name, _ in columns]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in body)
    return "\n".join(s.rstrip() for s in out)
