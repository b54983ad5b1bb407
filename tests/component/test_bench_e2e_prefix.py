"""bench/live/prefix.py's pure parts: the comparison with prefix-aware P/D, the table with missing
figures, and the traffic it replays (the workload, or a trace rescaled and cut)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.live.prefix import comparison, print_table, traffic


def _record(policy: str, rps: float, p95: float, turn2: float | None, attainment: float) -> dict[str, Any]:
    return {
        "policy": policy, "workload": "multiturn", "rps": rps, "p95_ttft_s": p95, "p95_ttft_turn1_s": p95,
        "p95_ttft_turn2plus_s": turn2, "p95_tbt_ms": 50.0, "tbt_violation_rate": 0.0, "slo_attainment": attainment,
        "deflections": 3, "prefix_hit_rate": None, "prefix_hit_rate_keep": None, "prefix_hit_rate_deflect": 0.5,
        "errors": 0,
    }  # fmt: skip


def test_comparison_takes_pd_first_rate_past_the_slo() -> None:
    records = [
        _record("kairos", 4.0, 1.0, 0.5, 1.0),
        _record("pd", 4.0, 2.0, 1.0, 0.9),
        _record("kairos", 8.0, 2.0, 1.0, 0.95),
        _record("pd", 8.0, 6.0, 4.0, 0.6),
        _record("kairos", 12.0, 5.0, 3.0, 0.7),
        _record("pd", 12.0, 9.0, 8.0, 0.3),
    ]
    out = comparison(records)
    assert out["pd_first_over_ttft_slo_rps"] == 8.0
    assert out["kairos_over_pd_turn2plus_p95_ttft_there"] == pytest.approx(0.25)
    assert out["kairos_attainment_minus_pd_points"] == pytest.approx({"4": 10.0, "8": 35.0, "12": 40.0})


def test_comparison_without_a_knee_or_without_both_policies() -> None:
    low = [_record("kairos", 4.0, 1.0, None, 1.0), _record("pd", 4.0, 2.0, None, 0.9)]
    out = comparison(low)
    assert out["pd_first_over_ttft_slo_rps"] is None and out["kairos_over_pd_turn2plus_p95_ttft_there"] is None
    assert comparison([_record("kairos", 4.0, 1.0, 0.5, 1.0)]) == {}


def test_the_table_prints_missing_figures_as_dashes(capsys: pytest.CaptureFixture[str]) -> None:
    print_table([_record("pd:prefix=off", 4.0, 2.0, None, 0.9)])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("pd:prefix=off") and "-" in row.split() and "50.0" in row.split()


def test_a_trace_is_rescaled_to_each_rate_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = (
        {"timestamp": 1000 * i, "input_length": 600, "output_length": 5, "hash_ids": [i % 3, i + 7]} for i in range(40)
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(trace=path, duration=10.0, seed=1)
    reqs = traffic(2.0, args)
    assert len(reqs) == 20 and reqs[-1].arrival_s < 10.0 and all(r.block_hashes for r in reqs)
    multiturn = traffic(4.0, argparse.Namespace(trace=None, duration=10.0, seed=1))
    assert multiturn and all(r.session_id is not None for r in multiturn)
