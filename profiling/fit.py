"""Fit a latency profile to step records (paper §5.2): ``kairos profile fit DIR... --out FILE``.

Each step model is a scikit-learn ``LinearRegression`` over the contract's features
(:mod:`kairos.profiling.features`, the same formulas :mod:`kairos.core.latency` evaluates), by default with
non-negative coefficients (``positive=True``: every feature is a cost that can only add time;
the intercept is free unless it comes out negative, then the fit goes through the origin).
Order matters: the decode model T0(B, K) is fitted first on decode-only steps, then the mixed
increment on ``duration - T0(B, K)`` of the mixed steps. The knee of ``prefill_step`` and
``mixed_increment`` is chosen by a grid search (coarse, then fine around the best) minimising
the training error.

Errors are measured on held-out *runs* (``GroupKFold`` by run file): the whole procedure, knee
search and the decode fit behind the mixed target included, is repeated on the training runs of
each fold and scored on its test runs. Consecutive steps of one run share their batch, so a
random row split would score memorised batches. The profile stores that held-out MAPE (None
when the records hold a single run for the model), then the final models are fitted on all rows.

The KV-transfer model (latency + bytes / bandwidth) is fitted from ``transfers.jsonl``
({"tokens", "seconds"[, "bytes"]}) when a directory has one, else copied from ``--base``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupKFold

from kairos.common import contracts as c
from kairos.common.errors import ProfileError
from kairos.core.latency import LatencyModels, LinearModel, TransferModel, check_operating_range
from kairos.profiling import features
from kairos.profiling.dataset import STEP_MODELS, Floats, Steps, mape, profile_predictions, split_by_model
from kairos.profiling.records import MANIFEST_FILE, RunFile, TransferRecord, load_runs, load_transfers

MAPE_DEFINITION = (
    "held-out mean absolute percentage error (fraction) over whole steps, by run (GroupKFold); "
    "mixed_increment is scored on mixed steps as decode_step + mixed_increment against the measured step"
)


@dataclass(frozen=True)
class FitConfig:
    """How the models are fitted."""

    positive: bool = True  # non-negative coefficients (scipy NNLS); the intercept is free
    knee_step: int = 64  # coarse knee grid spacing (tokens)
    knee_refine_step: int = 4  # fine grid spacing around the best coarse knee
    folds: int = 5  # GroupKFold splits, at most the number of runs
    min_samples: int = 5  # fewer rows than this: the model is copied from the base profile
    # Steps whose relative residual is more than this many robust standard deviations (1.4826 x
    # MAD) from the median are interference (another process took the core, a GC pause), not
    # the model's to explain: least squares would bend every coefficient towards them. 0 = off.
    outlier_mad: float = 5.0

    def __post_init__(self) -> None:
        if self.knee_step < 1 or self.knee_refine_step < 1 or self.knee_refine_step > self.knee_step:
            raise ProfileError(
                f"knee_step={self.knee_step} and knee_refine_step={self.knee_refine_step} must be >= 1, "
                "the fine step no larger than the coarse one"
            )
        if self.folds < 2:
            raise ProfileError(f"folds must be >= 2, got {self.folds}")
        if self.min_samples < 2:
            raise ProfileError(f"min_samples must be >= 2, got {self.min_samples}")
        if self.outlier_mad < 0:
            raise ProfileError(f"outlier_mad must be >= 0 (0 = keep every step), got {self.outlier_mad}")


@dataclass(frozen=True)
class Fitted:
    """One fitted step model: the sklearn estimator on column-scaled features, and its knee."""

    name: str
    knee: float  # tokens (0 for decode_step)
    estimator: LinearRegression
    scale: Floats  # each feature column was divided by this before fitting (conditioning)
    samples: int
    outliers: int = 0  # rows left out of the final fit as interference

    def design(self, s: Steps) -> Floats:
        return design(self.name, s, self.knee)

    def predict(self, s: Steps) -> Floats:
        """sklearn's prediction (for the mixed model: the increment only)."""
        return self.estimator.predict(self.design(s) / self.scale)

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.estimator.coef_ / self.scale)

    @property
    def intercept(self) -> float:
        return float(self.estimator.intercept_)

    def linear(self, mape_value: float | None) -> LinearModel:
        return LinearModel(
            name=self.name,
            features=c.LINEAR_MODEL_FEATURES[self.name],
            coefficients=self.coefficients,
            intercept=self.intercept,
            knee_tokens=self.knee,
            mape=mape_value,
            samples=self.samples,
        )


def design(name: str, s: Steps, knee: float) -> Floats:
    """The contract features of model ``name`` for rows ``s`` (one builder per model)."""
    if name == c.PREFILL_STEP:
        return features.prefill_features(s.prefill_tokens, s.cached, knee)
    if name == c.DECODE_STEP:
        return features.decode_features(s.decode_tokens, s.kv_tokens)
    return features.mixed_features(s.step_tokens, s.cached, s.decode_tokens, s.kv_tokens, knee)


def _knee_variable(name: str, s: Steps) -> Floats:
    return s.prefill_tokens if name == c.PREFILL_STEP else s.step_tokens


# A predictor of T0(B, K) for rows: a fitted decode model, or a base profile's.
DecodePredictor = Callable[[Steps], Floats]


def inliers(predicted: Floats, measured: Floats, k: float) -> np.ndarray:
    """Rows whose relative residual lies within ``k`` robust standard deviations of the median
    (all rows when ``k`` is 0 or the residuals have no spread)."""
    rel = (measured - predicted) / np.maximum(np.abs(predicted), 1e-12)
    center = np.median(rel)
    # Floor the spread at 0.1%: on clean records nothing is "interference" within k x 0.1%.
    spread = max(1.4826 * float(np.median(np.abs(rel - center))), 1e-3)
    if k <= 0:
        return np.ones(len(rel), dtype=bool)
    return np.abs(rel - center) <= k * spread


def _fit_at(name: str, s: Steps, y: Floats, knee: float, cfg: FitConfig, robust: bool = True) -> tuple[Fitted, float]:
    x = design(name, s, knee)
    # Features span 1 to 1e9 (p x K): scale columns to [-1, 1] so least squares stays well
    # conditioned; dividing the coefficients by the scale afterwards is exact.
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    keep = np.ones(len(y), dtype=bool)
    est = LinearRegression(positive=cfg.positive).fit(xs, y)
    for _ in range(3 if robust else 0):  # refit without interference outliers until the set settles
        now = inliers(est.predict(xs), y, cfg.outlier_mad)
        if now.sum() < cfg.min_samples or (now == keep).all():
            break
        keep = now
        est = LinearRegression(positive=cfg.positive).fit(xs[keep], y[keep])
    if est.intercept_ < 0:
        # A step's fixed cost (the weight read, the launch) cannot be negative; noisy timings on
        # a busy host can pull the free intercept below zero when the features move together
        # (the microbenchmark's K grows with every step). Then through the origin instead.
        est = LinearRegression(positive=cfg.positive, fit_intercept=False).fit(xs[keep], y[keep])
    sse = float(np.sum((est.predict(xs[keep]) - y[keep]) ** 2))
    return Fitted(name, knee, est, scale, len(s), int(len(y) - keep.sum())), sse


def fit_model(name: str, s: Steps, y: Floats, cfg: FitConfig) -> Fitted:
    """Fit one step model to targets ``y``; knee models search their knee on these rows only."""
    if name not in c.KNEE_MODELS:
        return _fit_at(name, s, y, 0.0, cfg)[0]
    top = float(np.max(_knee_variable(name, s)))
    step = cfg.knee_step
    coarse = np.arange(step, math.ceil(top / step) * step + step, step, dtype=np.float64)

    def knee_search(rows: Steps, target: Floats) -> float:
        # Plain least squares on one fixed set of rows, so every knee is scored on the same steps.
        best = min(coarse, key=lambda k: _fit_at(name, rows, target, k, cfg, robust=False)[1])
        fine = [k for k in np.arange(best - step, best + step + 1, cfg.knee_refine_step, dtype=np.float64) if k > 0]
        return min(fine, key=lambda k: (_fit_at(name, rows, target, k, cfg, robust=False)[1], k))

    knee = knee_search(s, y)
    if cfg.outlier_mad > 0:  # again without the interference steps a robust fit at that knee finds
        provisional = _fit_at(name, s, y, knee, cfg)[0]
        keep = inliers(provisional.predict(s), y, cfg.outlier_mad)
        if keep.sum() >= cfg.min_samples and not keep.all():
            knee = knee_search(s.take(np.flatnonzero(keep)), y[keep])
    return _fit_at(name, s, y, knee, cfg)[0]


def _decode_of(fitted: Fitted) -> DecodePredictor:
    return fitted.predict


def _base_decode(base: LatencyModels) -> DecodePredictor:
    d = base.decode
    return lambda s: d.intercept + features.decode_features(s.decode_tokens, s.kv_tokens) @ np.array(d.coefficients)


def fit_step_models(data: dict[str, Steps], cfg: FitConfig, base_decode: DecodePredictor) -> dict[str, Fitted]:
    """The step models that have enough rows, decode first: the mixed target subtracts the
    fitted T0(B, K), or the base profile's when there are too few decode-only steps."""
    out: dict[str, Fitted] = {}
    decode = base_decode
    for name in STEP_MODELS:
        s = data[name]
        if len(s) < cfg.min_samples:
            continue
        y = s.duration - decode(s) if name == c.MIXED_INCREMENT else s.duration
        out[name] = fit_model(name, s, y, cfg)
        if name == c.DECODE_STEP:
            decode = _decode_of(out[name])
    return out


@dataclass(frozen=True)
class HeldOut:
    """Out-of-fold predictions of one model (whole-step durations)."""

    mape: float | None  # None: fewer than two runs, nothing to hold out; interference steps excluded
    folds: int
    runs: int
    measured: Floats = field(repr=False)
    predicted: Floats = field(repr=False)
    mape_all: float | None = None  # over every held-out step, interference included
    outlier_fraction: float = 0.0  # held-out steps the robust rule set aside


def held_out(data: dict[str, Steps], cfg: FitConfig, base_decode: DecodePredictor) -> dict[str, HeldOut]:
    """Score each step model on runs its fit never saw (GroupKFold over run ids)."""
    out: dict[str, HeldOut] = {}
    empty = np.empty(0)
    for name in STEP_MODELS:
        s = data[name]
        runs = s.runs
        if len(s) < cfg.min_samples:
            continue
        if len(runs) < 2:
            out[name] = HeldOut(None, 0, len(runs), empty, empty)
            continue
        folds = min(cfg.folds, len(runs))
        measured, predicted = [], []
        for train, test in GroupKFold(n_splits=folds).split(s.duration, groups=s.run):
            s_train, s_test = s.take(train), s.take(test)
            if len(s_train) < cfg.min_samples:
                continue
            if name == c.MIXED_INCREMENT:
                decode_rows = data[c.DECODE_STEP].without_runs(set(s_test.runs))
                decode = (
                    _decode_of(fit_model(c.DECODE_STEP, decode_rows, decode_rows.duration, cfg))
                    if len(decode_rows) >= cfg.min_samples
                    else base_decode
                )
                fitted = fit_model(name, s_train, s_train.duration - decode(s_train), cfg)
                pred = decode(s_test) + fitted.predict(s_test)
            else:
                pred = fit_model(name, s_train, s_train.duration, cfg).predict(s_test)
            measured.append(s_test.duration)
            predicted.append(pred)
        if not measured:
            out[name] = HeldOut(None, 0, len(runs), empty, empty)
            continue
        m, p = np.concatenate(measured), np.concatenate(predicted)
        keep = inliers(p, m, cfg.outlier_mad)
        out[name] = HeldOut(mape(p[keep], m[keep]), folds, len(runs), m, p, mape(p, m), float(1 - keep.mean()))
    return out


# ---------------------------------------------------------------------------------------------
# KV transfer
# ---------------------------------------------------------------------------------------------
def fit_transfer(
    transfers: Sequence[TransferRecord], base: LatencyModels, bytes_per_token: float | None
) -> tuple[TransferModel, dict[str, Any]]:
    """latency + bytes / bandwidth from transfer records; the base's model when there are none.

    Tokens and seconds alone fix only ``bytes_per_token / bandwidth``: bytes per token comes from
    the records' ``bytes``, else ``bytes_per_token``, else the base profile."""
    if not transfers:
        note = {
            "source": "copied from the base profile: no transfers.jsonl in the record directories",
            "base": base.name,
        }
        return base.transfer, note
    tokens = np.array([t.tokens for t in transfers], dtype=np.float64)
    seconds = np.array([t.seconds for t in transfers], dtype=np.float64)
    if all(t.bytes is not None for t in transfers):
        nbytes = np.array([t.bytes for t in transfers], dtype=np.float64)
        bpt, bpt_source = float(np.median(nbytes / tokens)), "median bytes/token of the records"
    else:
        bpt = bytes_per_token or base.transfer.bytes_per_token
        bpt_source = "--kv-bytes-per-token" if bytes_per_token else f"base profile {base.name}"
        nbytes = tokens * bpt

    def fit(x: Floats, y: Floats) -> tuple[float, float]:
        est = LinearRegression(positive=True).fit(x.reshape(-1, 1) / 1e9, y)
        if est.intercept_ < 0:  # a set-up cost cannot be negative: through the origin instead
            est = LinearRegression(positive=True, fit_intercept=False).fit(x.reshape(-1, 1) / 1e9, y)
        slope = float(est.coef_[0]) / 1e9
        if slope <= 0:
            raise ProfileError("kv_transfer: transfer time does not grow with size in transfers.jsonl; cannot fit")
        return max(0.0, float(est.intercept_)), slope

    runs = np.array([t.run for t in transfers])
    held: float | None = None
    if len(set(runs.tolist())) >= 2:
        pred = np.empty_like(seconds)
        for train, test in GroupKFold(n_splits=min(5, len(set(runs.tolist())))).split(seconds, groups=runs):
            lat, slope = fit(nbytes[train], seconds[train])
            pred[test] = lat + slope * nbytes[test]
        held = mape(pred, seconds)
    latency, slope = fit(nbytes, seconds)
    model = TransferModel(bpt, 1.0 / slope, latency, mape=held)
    note = {
        "source": f"fitted on {len(transfers)} transfers",
        "files": sorted(set(runs.tolist())),
        "bytes_per_token_from": bpt_source,
        "in_sample_mape": mape(latency + slope * nbytes, seconds),
    }
    return model, note


# ---------------------------------------------------------------------------------------------
# The whole fit
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileMeta:
    """The profile's descriptive fields; None = taken from the collection manifests."""

    name: str
    model: str | None = None
    hardware: str | None = None


@dataclass(frozen=True)
class FitResult:
    profile: LatencyModels
    fitted: dict[str, Fitted]  # the step models fitted here (others came from the base)
    held_out: dict[str, HeldOut]
    data: dict[str, Steps]  # the rows of each model
    copied: tuple[str, ...]  # models copied from the base profile


def _manifests(paths: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for d in dict.fromkeys(p if p.is_dir() else p.parent for p in paths):
        f = d / MANIFEST_FILE
        if f.is_file():
            try:
                m = json.loads(f.read_text())
            except ValueError:
                continue
            if isinstance(m, dict):
                out.append(
                    {k: m.get(k) for k in ("node", "node_id", "role", "model", "time_scale", "source")}
                    | {"dir": str(d)}
                )
    return out


def _only(values: list[Any]) -> Any:
    distinct = sorted({str(v) for v in values if v})
    return distinct[0] if len(distinct) == 1 else None


def fit_profile(
    paths: Sequence[Path | str],
    meta: ProfileMeta,
    base: LatencyModels,
    cfg: FitConfig | None = None,
    kv_bytes_per_token: float | None = None,
) -> FitResult:
    """Load every run under ``paths``, fit the four models, and assemble the profile."""
    cfg = cfg or FitConfig()
    paths = [Path(p) for p in paths]
    runs: list[RunFile] = load_runs(paths)
    data = split_by_model(r for run in runs for r in run.records)
    fitted = fit_step_models(data, cfg, _base_decode(base))
    scores = held_out(data, cfg, _base_decode(base))

    def model_of(name: str, base_model: LinearModel) -> LinearModel:
        if name in fitted:
            h = scores.get(name)
            return fitted[name].linear(h.mape if h else None)
        return base_model

    copied = tuple(n for n in STEP_MODELS if n not in fitted)
    transfer, transfer_note = fit_transfer(load_transfers(paths), base, kv_bytes_per_token)
    if transfer_note["source"].startswith("copied"):
        copied += (c.KV_TRANSFER,)
    manifests = _manifests(paths)
    provenance: dict[str, Any] = {
        "kind": "measured",
        "measured": True,
        "tool": "kairos profile fit",
        "fitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "summary": f"fitted with scikit-learn on {sum(len(r.records) for r in runs)} engine steps from "
        f"{len(runs)} runs",
        "runs": [
            {
                "file": str(r.path),
                "sha256": r.sha256,
                "steps": len(r.records),
                "roles": sorted({x.role or "unknown" for x in r.records}),
            }
            for r in runs
        ],
        "split": {
            "method": "GroupKFold by run file (every row of a run in the same fold)",
            "folds": {n: h.folds for n, h in scores.items()},
            "runs": {n: h.runs for n, h in scores.items()},
            "held_out_mape_all_steps": {n: h.mape_all for n, h in scores.items()},
            "held_out_outlier_fraction": {n: h.outlier_fraction for n, h in scores.items()},
        },
        "mape_definition": MAPE_DEFINITION,
        "fit": {
            "estimator": "sklearn.linear_model.LinearRegression",
            "positive": cfg.positive,
            "outliers": f"steps beyond {cfg.outlier_mad:g} x 1.4826 MAD of the relative residual are refitted "
            "without (interference, not model error); 0 = off",
            "outliers_left_out": {n: f.outliers for n, f in fitted.items()},
            "knee_search": f"training-SSE grid, step {cfg.knee_step} then {cfg.knee_refine_step} tokens",
            "mixed_target": "duration - decode_step prediction, on mixed steps"
            + ("" if c.DECODE_STEP in fitted else f" (decode_step of the base profile {base.name})"),
        },
        "kv_transfer": transfer_note,
        "collections": manifests,
    }
    if copied:
        provenance["copied_from_base"] = {"profile": base.name, "models": list(copied)}
    profile = LatencyModels(
        name=meta.name,
        model=meta.model or _only([m.get("model") for m in manifests]) or "unknown",
        hardware=meta.hardware or "unspecified",
        provenance=provenance,
        prefill=model_of(c.PREFILL_STEP, base.prefill),
        decode=model_of(c.DECODE_STEP, base.decode),
        mixed=model_of(c.MIXED_INCREMENT, base.mixed),
        transfer=transfer,
    )
    try:
        check_operating_range(profile, f"the fitted profile {meta.name!r}")
    except ProfileError as exc:
        hint = (
            " (fitted with --allow-negative: plain least squares; without it every coefficient is >= 0)"
            if not cfg.positive
            else ""
        )
        raise ProfileError(exc.message + hint) from None
    return FitResult(profile, fitted, scores, data, copied)


def write_profile(profile: LatencyModels, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def format_table(result: FitResult) -> str:
    p = result.profile
    rows = [("model", "samples", "runs", "held-out MAPE", "all steps", "outliers", "knee", "intercept", "coefficients")]
    for name, m in ((c.DECODE_STEP, p.decode), (c.PREFILL_STEP, p.prefill), (c.MIXED_INCREMENT, p.mixed)):
        h = result.held_out.get(name)
        src = "" if name in result.fitted else " (base)"
        coefs = " ".join(f"{f}={v:.4g}" for f, v in zip(m.features, m.coefficients, strict=True))
        rows.append(
            (
                name + src,
                "-" if m.samples is None or src else str(m.samples),
                "-" if h is None or src else str(h.runs),
                "-" if src else _pct(m.mape),
                "-" if h is None or src else _pct(h.mape_all),
                "-" if h is None or src else _pct(h.outlier_fraction),
                f"{m.knee_tokens:g}" if name in c.KNEE_MODELS else "-",
                f"{m.intercept:.4g}",
                coefs,
            )
        )
    t = p.transfer
    src = " (base)" if c.KV_TRANSFER in result.copied else ""
    rows.append(
        (
            c.KV_TRANSFER + src,
            "-",
            "-",
            _pct(t.mape),
            "-",
            "-",
            "-",
            f"{t.latency_s:.4g}",
            f"bytes_per_token={t.bytes_per_token:g} bandwidth_bytes_per_s={t.bandwidth_bytes_per_s:.4g}",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows
    )


def format_profile(p: LatencyModels) -> str:
    """What a profile is of, where it came from, and each model's held-out MAPE (``kairos profile
    show``): the error it was measured with, not one measured now (``kairos profile check``)."""
    prov = p.provenance
    base = prov.get("copied_from_base", {})
    copied = set(base.get("models", ()))
    source = "measured" if prov.get("measured") else f"not measured ({prov.get('kind', 'unknown')})"
    lines = [p.name, f"  model     {p.model}", f"  hardware  {p.hardware}", f"  source    {source}"]
    if prov.get("fitted_at"):
        lines.append(f"  fitted    {prov['fitted_at']}")
    rows = [("model", "samples", "held-out MAPE", "")]
    for name, m in ((c.DECODE_STEP, p.decode), (c.PREFILL_STEP, p.prefill), (c.MIXED_INCREMENT, p.mixed)):
        rows.append((name, "-" if m.samples is None else str(m.samples), _pct(m.mape), ""))
    rows.append((c.KV_TRANSFER, "-", _pct(p.transfer.mape), ""))
    rows = [(*r[:3], f"copied from {base.get('profile')}" if r[0] in copied else r[3]) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    return "\n".join(line.rstrip() for line in lines)


def write_plots(result: FitResult, out_dir: Path) -> list[Path]:
    """Predicted vs measured step time per fitted model (held-out predictions where the records
    have several runs, in-sample ones otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    p = result.profile
    for name in result.fitted:
        h = result.held_out.get(name)
        if h is not None and h.mape is not None:
            measured, predicted, label = h.measured, h.predicted, f"held-out runs, MAPE {_pct(h.mape)}"
        else:
            s = result.data[name]
            measured = s.duration
            predicted = profile_predictions(p, name, s)
            label = f"in-sample (one run), MAPE {_pct(mape(predicted, measured))}"
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(measured * 1e3, predicted * 1e3, s=6, alpha=0.5)
        hi = float(max(measured.max(), predicted.max()) * 1e3 * 1.05)
        ax.plot([0, hi], [0, hi], color="black", linewidth=0.8)
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel("measured step time (ms)")
        ax.set_ylabel("predicted step time (ms)")
        ax.set_title(f"{name}{' (whole step)' if name == c.MIXED_INCREMENT else ''}\n{label}", fontsize=10)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight", facecolor="white")
        plt.close(fig)
        written.append(path)
    return written
