"""`kairos profile check`: a profile measured on fresh records, drift flagged against its
stored MAPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.common.errors import ConfigError
from kairos.core.latency import LatencyModels, load_profile
from kairos.profiling.__main__ import main
from kairos.profiling.check import CheckConfig, check_profile, format_report
from kairos.profiling.fit import write_profile
from kairos.profiling.plan import PlanConfig, plan_phases
from tests.synthetic_runs import write_runs

TRUTH = load_profile()


def scaled(models: LatencyModels, factor: float, stored_mape: float | None = 0.01) -> LatencyModels:
    """``models`` with every step model ``factor`` times slower, storing ``stored_mape``."""
    d: dict[str, Any] = json.loads(json.dumps(models.to_dict()))
    for name in (c.PREFILL_STEP, c.DECODE_STEP, c.MIXED_INCREMENT):
        m = d["models"][name]
        m["coefficients"] = [x * factor for x in m["coefficients"]]
        m["intercept"] *= factor
        m["mape"] = stored_mape
    return LatencyModels.from_dict(d, "test")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Fresh records from a node whose true step times are TRUTH's."""
    root = tmp_path_factory.mktemp("fresh")
    write_runs(root / "p", plan_phases(PlanConfig(role="prefill", rates=(2.0,), duration_s=20)), "prefill", TRUTH)
    plan = PlanConfig(role="decode", rates=(2.0,), duration_s=20, batch_sizes=(8,), contexts=(3569,))
    write_runs(root / "d", plan_phases(plan), "decode", TRUTH)
    return [root / "p", root / "d"]


def test_a_matching_profile_passes(fresh: list[Path]) -> None:
    report = check_profile(scaled(TRUTH, 1.0), fresh)
    assert not report.drifted
    assert [r.model for r in report.rows] == [c.DECODE_STEP, c.PREFILL_STEP, c.MIXED_INCREMENT]
    for row in report.rows:
        assert row.status == "ok" and row.fresh_mape is not None and row.fresh_mape < 1e-9
        assert row.stored_mape == 0.01 and row.allowed_mape == pytest.approx(0.06)
        assert row.samples >= 20


def test_scaled_coefficients_are_drift(fresh: list[Path]) -> None:
    # The profile predicts 25% slower steps than the node has: MAPE 25% > 1% + 5%.
    report = check_profile(scaled(TRUTH, 1.25), fresh)
    assert report.drifted
    for row in report.rows:
        assert row.status == "drift"
        assert row.fresh_mape == pytest.approx(0.25, rel=1e-6)
    text = format_report(report)
    assert "DRIFT" in text and "re-profile" in text


def test_threshold_decides(fresh: list[Path]) -> None:
    # 3% slower: within a 5-point threshold, drift at 1 point.
    assert not check_profile(scaled(TRUTH, 1.03, None), fresh).drifted
    report = check_profile(scaled(TRUTH, 1.03, None), fresh, CheckConfig(threshold=0.01))
    assert report.drifted and all(r.allowed_mape == 0.01 for r in report.rows)  # no stored MAPE: 0 + 1 point


def test_too_few_samples_are_not_judged(fresh: list[Path]) -> None:
    report = check_profile(scaled(TRUTH, 2.0), fresh, CheckConfig(min_samples=10**6))
    assert not report.drifted and {r.status for r in report.rows} == {"too few samples"}


def test_transfers_are_checked_when_present(tmp_path: Path, fresh: list[Path]) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "r.jsonl").write_text((fresh[1] / "trace-r2.jsonl").read_text())
    rows = [{"tokens": n, "seconds": TRUTH.kv_transfer_s(n) * 1.5} for n in range(100, 3100, 100)]
    (d / "transfers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_profile(TRUTH, [d])
    t = next(r for r in report.rows if r.model == c.KV_TRANSFER)
    assert t.samples == 30 and t.status == "drift" and t.fresh_mape == pytest.approx(1 / 3)


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        CheckConfig(threshold=-1)


def test_cli_exit_codes_and_json(tmp_path: Path, fresh: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    write_profile(scaled(TRUTH, 1.0), good)
    write_profile(scaled(TRUTH, 1.25), bad)
    dirs = [str(p) for p in fresh]
    assert main(["check", str(good), *dirs]) == 0
    assert "no drift" in capsys.readouterr().out
    assert main(["check", str(bad), *dirs, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["drifted"] is True and {m["status"] for m in report["models"]} == {"drift"}
    assert main(["check", str(bad), *dirs, "--threshold", "0.5"]) == 0
    capsys.readouterr()
    assert main(["check", str(tmp_path / "missing.json"), *dirs]) == 2
    assert "kairos profile check: error: profile file" in capsys.readouterr().err


def test_profile_command_registers_on_the_kairos_parser(fresh: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    """What kairos/launcher/cli.py does with add_profile_parser: `kairos profile check ...` runs."""
    import argparse

    from kairos.profiling.cli import add_profile_parser

    parser = argparse.ArgumentParser(prog="kairos")
    add_profile_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", "check", "deepseek-v2-lite-a100", *map(str, fresh), "--threshold", "1"])
    assert args.handler(args) == 0
    assert "profile deepseek-v2-lite-a100: no drift" in capsys.readouterr().out
