"""Check a profile against fresh step records: ``kairos profile check PROFILE DIR...``.

Each model's MAPE on the fresh records (through the dispatcher's own evaluator,
:func:`kairos.profiling.dataset.profile_predictions`) is compared with the held-out MAPE the profile
stores; a model has *drifted* when the fresh MAPE exceeds the stored one (0 when the profile
stores none) by more than the threshold. Models with too few fresh rows are reported, not judged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kairos.common import contracts as c
from kairos.common.errors import ConfigError
from kairos.core.latency import LatencyModels
from kairos.profiling.dataset import STEP_MODELS, mape, profile_predictions, split_by_model
from kairos.profiling.records import load_runs, load_transfers


@dataclass(frozen=True)
class CheckConfig:
    threshold: float = 0.05  # allowed MAPE increase over the stored one (fraction: 0.05 = 5 points)
    min_samples: int = 20  # fewer fresh rows: "too few samples", never drift

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ConfigError(f"threshold must be >= 0, got {self.threshold}")
        if self.min_samples < 1:
            raise ConfigError(f"min_samples must be >= 1, got {self.min_samples}")


@dataclass(frozen=True)
class CheckRow:
    model: str
    samples: int  # fresh rows
    runs: int
    fresh_mape: float | None  # None: too few rows
    stored_mape: float | None  # what the profile says (held-out MAPE at fit time)
    allowed_mape: float  # stored (or 0) + threshold
    status: str  # "ok", "drift" or "too few samples"

    @property
    def drifted(self) -> bool:
        return self.status == "drift"


@dataclass(frozen=True)
class CheckReport:
    profile: str
    threshold: float
    rows: tuple[CheckRow, ...]

    @property
    def drifted(self) -> bool:
        return any(r.drifted for r in self.rows)

    def to_dict(self) -> dict[str, object]:
        return {
            "profile": self.profile,
            "threshold": self.threshold,
            "drifted": self.drifted,
            "models": [asdict(r) for r in self.rows],
        }


def _row(model: str, samples: int, runs: int, fresh: float | None, stored: float | None, cfg: CheckConfig) -> CheckRow:
    allowed = (stored or 0.0) + cfg.threshold
    status = "too few samples" if fresh is None else "drift" if fresh > allowed else "ok"
    return CheckRow(model, samples, runs, fresh, stored, allowed, status)


def check_profile(models: LatencyModels, paths: Sequence[Path | str], cfg: CheckConfig | None = None) -> CheckReport:
    cfg = cfg or CheckConfig()
    runs = load_runs(paths)
    data = split_by_model(r for run in runs for r in run.records)
    stored = {
        c.PREFILL_STEP: models.prefill.mape,
        c.DECODE_STEP: models.decode.mape,
        c.MIXED_INCREMENT: models.mixed.mape,
    }
    rows = []
    for name in STEP_MODELS:
        s = data[name]
        fresh = mape(profile_predictions(models, name, s), s.duration) if len(s) >= cfg.min_samples else None
        rows.append(_row(name, len(s), len(s.runs), fresh, stored[name], cfg))
    transfers = load_transfers(paths)
    if transfers:
        tokens = np.array([t.tokens for t in transfers])
        seconds = np.array([t.seconds for t in transfers])
        pred = np.array([models.kv_transfer_s(int(n)) for n in tokens])
        fresh = mape(pred, seconds) if len(transfers) >= cfg.min_samples else None
        n_runs = len({t.run for t in transfers})
        rows.append(_row(c.KV_TRANSFER, len(transfers), n_runs, fresh, models.transfer.mape, cfg))
    return CheckReport(models.name, cfg.threshold, tuple(rows))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def format_report(report: CheckReport) -> str:
    head = ("model", "samples", "runs", "fresh MAPE", "stored MAPE", "allowed", "status")
    rows = [head] + [
        (
            r.model,
            str(r.samples),
            str(r.runs),
            _pct(r.fresh_mape),
            _pct(r.stored_mape),
            _pct(r.allowed_mape),
            r.status.upper() if r.drifted else r.status,
        )
        for r in report.rows
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    verdict = "DRIFT: re-profile (kairos profile collect + fit)" if report.drifted else "no drift"
    return "\n".join([*lines, f"profile {report.profile}: {verdict} (threshold +{_pct(report.threshold)})"])


def report_json(report: CheckReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
