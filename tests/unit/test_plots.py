"""Tests for kairos.sim.plots: figure files from synthetic `kairos sim` records, and the text table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import pytest

from kairos.sim.plots import format_table, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MULTI_RATE_FILES = {"fig4_ttft_tbt.png", "fig5_throughput.png", "fig6_attainment_deflections.png", "ttft_breakdown.png"}


def make_record(policy: str, rps: float, *, deflect: bool, spec: str | None = None) -> dict[str, Any]:
    """One plausible result record; load grows with rps, deflecting policies trade TBT for TTFT."""
    load = (rps - 5.0) / 7.0
    gain = 0.6 if deflect else 1.0
    p95_ttft = (1.5 + 6.0 * load**2) * gain
    return {
        "policy": policy,
        "policy_spec": spec or policy,
        "rps": float(rps),
        "workload": "bursty",
        "requests": int(rps * 120),
        "deflections": int(500 - 20 * rps) if deflect else 0,
        "p50_ttft_s": p95_ttft * 0.35,
        "p95_ttft_s": p95_ttft,
        "p99_ttft_s": p95_ttft * 1.3,
        "p95_ttft_keep_s": p95_ttft * 1.05,
        "p95_ttft_deflect_s": p95_ttft * 0.4 if deflect else 0.0,
        "p95_prefill_queue_s": 0.8 * load * gain,
        "p95_prefill_exec_s": 1.0,
        "p95_kv_transfer_s": 2.0 * load * gain,
        "p95_decode_queue_s": 0.05,
        "p50_tbt_ms": 50.0 + (5.0 if deflect else 0.0),
        "p95_tbt_ms": 55.0 + 8.0 * load + (6.0 if deflect else 0.0),
        "p99_tbt_ms": 62.0 + 8.0 * load,
        "max_tbt_ms": 80.0,
        "tbt_violation_rate": 0.0 if deflect else 0.01 * load,
        "slo_attainment": min(1.0, 1.15 - 0.25 * load * gain),
        "output_tokens_per_s": 180.0 * rps * (1.0 - 0.1 * load * gain),
        "total_tokens_per_s": 2400.0 * rps * (1.0 - 0.1 * load * gain),
        "ttft_prediction_mape": 0.06 if deflect else 0.0,
        "tbt_slo_ms": 70.0,
        "ttft_slo_s": 4.0,
    }


POLICIES = (("pd", False), ("kairos(alpha=1.3,beta=1)", True), ("sq(theta=4)", False))
RATES = (10.0, 6.0, 8.0)  # deliberately unsorted


def multi_rate_records() -> list[dict[str, Any]]:
    return [make_record(p, r, deflect=d) for p, d in POLICIES for r in RATES]


def single_rate_records() -> list[dict[str, Any]]:
    specs = [
        ("pd", False),
        ("sq(theta=4)", False),
        ("sl(l=2048)", True),
        ("oracle(alpha=1.3,beta=1)", True),
        ("kairos(alpha=1.3,beta=1)", True),
    ]
    return [make_record(p, 9.0, deflect=d) for p, d in specs]


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, (path, len(data))
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    assert img.shape[0] > 200 and img.shape[1] > 300, img.shape


def test_multi_rate_writes_all_figures(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "plots"
    paths = write_plots(multi_rate_records(), out)
    assert {p.name for p in paths} == MULTI_RATE_FILES  # no fig2 with several rates
    assert all(p.parent == out for p in paths)
    for p in paths:
        assert_png(p)


def test_single_rate_adds_policy_comparison(tmp_path: Path) -> None:
    paths = write_plots(single_rate_records(), tmp_path)
    assert {p.name for p in paths} == MULTI_RATE_FILES | {"fig2_policies.png"}
    for p in paths:
        assert_png(p)


def test_single_policy_without_deflections(tmp_path: Path) -> None:
    records = [make_record("pd", r, deflect=False) for r in RATES]
    paths = write_plots(records, tmp_path)
    # fig6 still exists (attainment panel); the deflection panel is dropped, not crashed on.
    assert {p.name for p in paths} == MULTI_RATE_FILES
    for p in paths:
        assert_png(p)


def test_missing_optional_keys_skip_panels(tmp_path: Path) -> None:
    records = multi_rate_records()
    for rec in records:
        for key in (
            "p95_prefill_queue_s",
            "p95_prefill_exec_s",
            "p95_kv_transfer_s",
            "p95_decode_queue_s",
            "total_tokens_per_s",
            "tbt_slo_ms",
        ):
            rec.pop(key)
        rec["output_tokens_per_s"] = math.nan
        rec["p95_tbt_ms"] = None
    paths = write_plots(records, tmp_path)
    names = {p.name for p in paths}
    assert "ttft_breakdown.png" not in names  # no component keys at all
    assert "fig5_throughput.png" not in names  # neither throughput value usable
    assert {"fig4_ttft_tbt.png", "fig6_attainment_deflections.png"} <= names
    for p in paths:
        assert_png(p)


def test_single_record(tmp_path: Path) -> None:
    paths = write_plots([make_record("pd", 6.0, deflect=False)], tmp_path)
    assert "fig2_policies.png" in {p.name for p in paths}
    for p in paths:
        assert_png(p)


def test_empty_records_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_plots([], tmp_path)


def test_format_table_rows_and_values() -> None:
    records = multi_rate_records()
    table = format_table(records)
    lines = table.splitlines()
    assert len(lines) == 2 + len(records)  # header, rule, one row per record
    header = lines[0].split()
    assert header[:2] == ["policy", "rps"]
    for label, _ in POLICIES:
        assert label in table
    rows = [line.split() for line in lines[2:]]
    # policy order of first appearance, then rps ascending
    assert [(r[0], r[1]) for r in rows] == [(p, f"{x:.2f}") for p, _ in POLICIES for x in sorted(RATES)]
    assert len({len(line) for line in lines}) == 1  # fixed width

    rec = make_record("kairos(alpha=1.3,beta=1)", 8.0, deflect=True)
    row = next(r for r in rows if r[0] == "kairos(alpha=1.3,beta=1)" and r[1] == "8.00")
    assert row == [
        "kairos(alpha=1.3,beta=1)",
        "8.00",
        f"{rec['p50_ttft_s']:.3f}",
        f"{rec['p95_ttft_s']:.3f}",
        f"{rec['p99_ttft_s']:.3f}",
        f"{rec['p95_tbt_ms']:.1f}",
        "0.00",
        f"{rec['slo_attainment'] * 100:.1f}",
        str(rec["deflections"]),
        f"{rec['output_tokens_per_s']:.1f}",
    ]
    assert row[8] == "340"


def test_format_table_missing_value_shows_dash() -> None:
    rec = make_record("pd", 6.0, deflect=False)
    del rec["p99_ttft_s"]
    row = format_table([rec]).splitlines()[2].split()
    assert row[4] == "-"


def test_conversation_records_add_the_later_turns_figure(tmp_path: Path) -> None:
    records = multi_rate_records()
    for i, rec in enumerate(records):
        rec.update(p95_ttft_turn2plus_s=0.3 + 0.1 * i, prefix_hit_rate_decode=0.7)
    paths = write_plots(records, tmp_path)
    assert {p.name for p in paths} == MULTI_RATE_FILES | {"prefix_turns.png"}
    for p in paths:
        assert_png(p)
