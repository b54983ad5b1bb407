"""The fitter: recovering the engine model's own coefficients from its step records (split by
run), the fitted profile evaluating exactly as sklearn predicts, transfers, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.core.latency import LatencyModels, load_profile
from kairos.profiling import features
from kairos.profiling.__main__ import main
from kairos.profiling.dataset import profile_predictions
from kairos.profiling.fit import FitConfig, FitResult, ProfileMeta, fit_profile, format_table, write_profile
from kairos.profiling.plan import PlanConfig, plan_phases
from kairos.profiling.records import StepKind, StepRecord
from kairos.sim.engine import StepPlan, model_step_time
from tests.builders import make_models
from tests.synthetic_runs import write_runs

TRUTH = load_profile()  # the packaged A100 profile: every coefficient non-zero, knees at 1600
# A second truth with other knees and magnitudes, so a fit cannot pass by being tuned to one.
OTHER = make_models(
    prefill_b0=0.02,
    prefill_per_token=3e-5,
    prefill_over_knee=5e-5,
    prefill_x_cached=2e-9,
    prefill_knee=1000,
    decode_b0=0.03,
    decode_per_b=4e-4,
    decode_per_k=5e-8,
    mixed_b0=0.004,
    mixed_per_p=2e-5,
    mixed_p_x_b=3e-7,
    mixed_p_x_k=1e-10,
    mixed_p_x_cached=5e-9,
    mixed_over_knee=6e-5,
    mixed_knee=1216,
)

PREFILL_PLAN = PlanConfig(role="prefill", rates=(1.0, 2.0, 4.0), duration_s=30)
DECODE_PLAN = PlanConfig(role="decode", rates=(1.0, 4.0), duration_s=30, batch_sizes=(4, 16, 32))


def collection(root: Path, truth: LatencyModels, timer=None) -> list[Path]:  # type: ignore[no-untyped-def]
    """Two collection directories (a prefill node and a decode node) of virtual-time runs."""
    write_runs(root / "p0", plan_phases(PREFILL_PLAN), "prefill", truth, timer=timer)
    write_runs(root / "d0", plan_phases(DECODE_PLAN), "decode", truth, timer=timer)
    return [root / "p0", root / "d0"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> FitResult:
    return fit_profile(collection(tmp_path_factory.mktemp("a100"), TRUTH), ProfileMeta("fitted"), TRUTH)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("truth", [TRUTH, OTHER], ids=["a100", "other"])
def test_fit_recovers_the_engine_models_coefficients(tmp_path: Path, truth: LatencyModels) -> None:
    result = fit_profile(collection(tmp_path, truth), ProfileMeta("fitted"), truth)
    got = result.profile
    assert set(result.fitted) == {c.DECODE_STEP, c.PREFILL_STEP, c.MIXED_INCREMENT}
    for mine, true in ((got.decode, truth.decode), (got.prefill, truth.prefill), (got.mixed, truth.mixed)):
        for feature, a, b in zip(true.features, mine.coefficients, true.coefficients, strict=True):
            assert rel(a, b) < 0.02, f"{true.name}.{feature}: fitted {a:.6g}, truth {b:.6g}"
        assert rel(mine.intercept, true.intercept) < 0.02, f"{true.name} intercept {mine.intercept} vs {true.intercept}"
        assert mine.knee_tokens == true.knee_tokens
        assert mine.samples and mine.samples > 50
    # Whole-step predictions on every recorded step, through the dispatcher's evaluator.
    for name, s in result.data.items():
        mine, true = profile_predictions(got, name, s), profile_predictions(truth, name, s)
        assert np.max(np.abs(mine - true) / true) < 0.02, name
        np.testing.assert_allclose(true, s.duration, rtol=1e-9)  # the records are the truth's own
    # Held out by run: every model scored on runs its fit never saw, with (near-)exact numbers.
    for name in result.fitted:
        h = result.held_out[name]
        assert h.folds >= 2 and h.runs >= 2 and h.mape is not None and h.mape < 0.02
    assert got.provenance["split"]["method"].startswith("GroupKFold by run")


def test_fit_with_noise_scores_at_the_noise_level(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    clean = model_step_time(TRUTH)

    def noisy(role: Role, plan: StepPlan) -> float:
        return clean(role, plan) * (1 + rng.uniform(-0.03, 0.03))  # mean |error| 1.5%

    result = fit_profile(collection(tmp_path, TRUTH, noisy), ProfileMeta("noisy"), TRUTH)
    for name in (c.DECODE_STEP, c.PREFILL_STEP, c.MIXED_INCREMENT):
        assert result.held_out[name].mape is not None and result.held_out[name].mape < 0.02, name
    assert abs(result.profile.prefill.knee_tokens - 1600) <= 100
    assert rel(result.profile.decode.intercept, TRUTH.decode.intercept) < 0.02


def test_interference_steps_are_set_aside_not_fitted(tmp_path: Path) -> None:
    """On a shared host a few steps stall (another process took the core): 2% of steps here take
    3-30x their time. The robust fit ignores them and says how many; plain least squares bends."""
    rng = np.random.default_rng(11)
    clean = model_step_time(TRUTH)

    def disturbed(role: Role, plan: StepPlan) -> float:
        t = clean(role, plan) * (1 + rng.uniform(-0.01, 0.01))
        return t * rng.uniform(3, 30) if rng.random() < 0.02 else t

    dirs = collection(tmp_path, TRUTH, disturbed)
    robust = fit_profile(dirs, ProfileMeta("robust"), TRUTH)
    plain = fit_profile(dirs, ProfileMeta("plain"), TRUTH, FitConfig(outlier_mad=0))
    assert rel(robust.profile.decode.intercept, TRUTH.decode.intercept) < 0.02
    assert rel(robust.profile.decode.coef("decode_tokens"), TRUTH.decode.coef("decode_tokens")) < 0.02
    assert rel(plain.profile.decode.intercept, TRUTH.decode.intercept) > 0.05
    for name in (c.DECODE_STEP, c.PREFILL_STEP, c.MIXED_INCREMENT):
        h = robust.held_out[name]
        assert h.mape is not None and h.mape < 0.02, name  # the model's error, interference aside
        assert h.mape_all is not None and h.mape_all > h.mape + 0.01, name  # what every step saw
        assert 0.005 < h.outlier_fraction < 0.06, name
        assert robust.fitted[name].outliers > 0
    split = robust.profile.provenance["split"]
    assert set(split["held_out_mape_all_steps"]) == set(split["held_out_outlier_fraction"]) == set(robust.fitted)


def test_profile_evaluates_exactly_as_sklearn_predicts(fitted: FitResult, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(fitted.profile, path)
    loaded = load_profile(path)  # file round trip: what the dispatcher will serve
    assert loaded.to_dict() == fitted.profile.to_dict()
    for name, model in fitted.fitted.items():
        s = fitted.data[name]
        sk = model.predict(s)  # sklearn's own predict on its scaled features
        if name == c.DECODE_STEP:
            ours = [loaded.decode_step_s(b, k) for b, k in zip(s.decode_tokens, s.kv_tokens, strict=True)]
        elif name == c.PREFILL_STEP:
            ours = [loaded.prefill_step_s(n, x) for n, x in zip(s.prefill_tokens, s.cached, strict=True)]
        else:
            rows = zip(s.step_tokens, s.cached, s.decode_tokens, s.kv_tokens, strict=True)
            ours = [loaded.mixed_increment_s(chi, x, b, k) for chi, x, b, k in rows]
        np.testing.assert_allclose(ours, sk, rtol=1e-9, atol=1e-12, err_msg=name)


def test_feature_builders_match_the_evaluator_on_random_rows() -> None:
    """features.py and kairos.core.latency compute the same terms, knee on either side."""
    rng = np.random.default_rng(3)
    n = 200
    chi = rng.integers(1, 4096, n).astype(float)
    b = np.minimum(rng.integers(0, 64, n), chi - 1).astype(float)
    k, cached = rng.integers(0, 500_000, n).astype(float), rng.integers(0, 30_000, n).astype(float)
    m = OTHER
    xp = features.prefill_features(chi, cached, m.prefill.knee_tokens)
    xd = features.decode_features(b, k)
    xm = features.mixed_features(chi, cached, b, k, m.mixed.knee_tokens)
    assert xp.shape[1] == len(c.LINEAR_MODEL_FEATURES[c.PREFILL_STEP])
    assert xd.shape[1] == len(c.LINEAR_MODEL_FEATURES[c.DECODE_STEP])
    assert xm.shape[1] == len(c.LINEAR_MODEL_FEATURES[c.MIXED_INCREMENT])
    for i in range(n):
        assert math.isclose(
            m.prefill.intercept + xp[i] @ m.prefill.coefficients, m.prefill_step_s(chi[i], cached[i]), rel_tol=1e-12
        )
        assert math.isclose(
            m.decode.intercept + xd[i] @ m.decode.coefficients, m.decode_step_s(b[i], k[i]), rel_tol=1e-12
        )
        assert math.isclose(
            m.mixed.intercept + xm[i] @ m.mixed.coefficients,
            m.mixed_increment_s(chi[i], cached[i], b[i], k[i]),
            rel_tol=1e-12,
        )


def test_held_out_is_by_run_never_by_row(tmp_path: Path) -> None:
    """Two decode runs from two different engines: a row split would score the mix well, a run
    split scores each run with a model fitted on the other one, so the error shows."""
    slow = LatencyModels.from_dict(
        {
            **TRUTH.to_dict(),
            "models": {
                **TRUTH.to_dict()["models"],
                c.DECODE_STEP: {**TRUTH.to_dict()["models"][c.DECODE_STEP], "intercept": 0.060},
            },
        }
    )
    plan = PlanConfig(role="decode", rates=(2.0,), duration_s=20, micro=False)
    write_runs(tmp_path / "a", plan_phases(plan), "decode", TRUTH)
    write_runs(tmp_path / "b", plan_phases(plan), "decode", slow)
    result = fit_profile([tmp_path / "a", tmp_path / "b"], ProfileMeta("x"), TRUTH)
    assert result.held_out[c.DECODE_STEP].folds == 2
    assert result.held_out[c.DECODE_STEP].mape > 0.10  # about 14 ms off on 50-65 ms steps


def test_missing_models_and_transfers_come_from_the_base(tmp_path: Path) -> None:
    write_runs(tmp_path / "p0", plan_phases(PREFILL_PLAN), "prefill", TRUTH)
    result = fit_profile([tmp_path / "p0"], ProfileMeta("p-only"), OTHER)
    assert result.copied == (c.DECODE_STEP, c.MIXED_INCREMENT, c.KV_TRANSFER)
    assert result.profile.decode == OTHER.decode and result.profile.transfer == OTHER.transfer
    assert rel(result.profile.prefill.coef("tokens"), TRUTH.prefill.coef("tokens")) < 0.02
    prov = result.profile.provenance
    assert prov["kind"] == "measured" and prov["measured"] is True
    assert prov["copied_from_base"]["models"] == [c.DECODE_STEP, c.MIXED_INCREMENT, c.KV_TRANSFER]
    assert prov["kv_transfer"]["source"].startswith("copied from the base profile")
    assert [len(r["sha256"]) for r in prov["runs"]] == [64, 64, 64]


def test_transfer_model_is_fitted_from_transfer_records(tmp_path: Path) -> None:
    for run, sizes in (("a", (1000, 4000, 9000)), ("b", (2000, 6000, 12000))):
        d = tmp_path / run
        write_runs(d, plan_phases(PlanConfig(role="prefill", rates=(2.0,), duration_s=10)), "prefill", TRUTH)
        rows = [{"tokens": n, "seconds": 0.003 + n * 20_000 / 2e9, "bytes": n * 20_000} for n in sizes]
        (d / "transfers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = fit_profile([tmp_path / "a", tmp_path / "b"], ProfileMeta("x"), TRUTH)
    t = result.profile.transfer
    assert t.bytes_per_token == 20_000
    assert rel(t.bandwidth_bytes_per_s, 2e9) < 1e-6 and rel(t.latency_s, 0.003) < 1e-6
    assert t.mape is not None and t.mape < 1e-6  # held out by file: two transfer runs
    assert c.KV_TRANSFER not in result.copied


def test_fit_config_is_checked() -> None:
    from kairos.common.errors import ProfileError

    with pytest.raises(ProfileError, match="knee_step=0"):
        FitConfig(knee_step=0)


def test_cli_fit_writes_profile_table_and_plots(
    fitted: FitResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = collection(tmp_path / "runs", TRUTH)
    out = tmp_path / "prof" / "tiny-cpu.json"
    rc = main(
        ["fit", *map(str, dirs), "--out", str(out), "--hardware", "2 CPU cores", "--plots", str(tmp_path / "plots")]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    prof = load_profile(out)
    assert (prof.name, prof.hardware, prof.model) == ("tiny-cpu", "2 CPU cores", TRUTH.model)
    assert "decode_step" in printed and "held-out MAPE" in printed and "kv_transfer (base)" in printed
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "decode_step.png",
        "mixed_increment.png",
        "prefill_step.png",
    ]
    assert format_table(fitted).splitlines()[0].startswith("model")


def test_cli_fit_reports_bad_input_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r.jsonl").write_text('{"index": 1}\n')
    assert main(["fit", str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    assert "kairos profile fit: error:" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_step_kinds_of_a_collection(fitted: FitResult) -> None:
    """The plan produces every kind of step the models need, in the expected places."""
    assert len(fitted.data[c.PREFILL_STEP]) > 100
    assert len(fitted.data[c.DECODE_STEP]) > 100
    assert len(fitted.data[c.MIXED_INCREMENT]) > 100
    rec = StepRecord("r", 0, 0.0, 0.1, 0, 0, ())
    assert rec.kind is StepKind.EMPTY


def test_a_negative_fixed_cost_is_refitted_through_the_origin() -> None:
    """Decode-only steps whose time grows faster than K alone explains (a busy host): least
    squares would put the intercept below zero, a fixed cost no engine has."""
    from kairos.profiling.dataset import Steps
    from kairos.profiling.fit import fit_model

    kv = np.arange(100.0, 2100.0, 100.0)
    n = kv.size
    steps = Steps(
        run=np.array(["r"] * n, dtype=np.str_),
        duration=4e-5 * kv - 0.002,  # exactly linear in K with a negative intercept
        decode_tokens=np.full(n, 2.0),
        kv_tokens=kv,
        prefill_tokens=np.zeros(n),
        step_tokens=np.full(n, 2.0),
        cached=np.zeros(n),
    )
    from sklearn.linear_model import LinearRegression

    free = LinearRegression(positive=True).fit(features.decode_features(steps.decode_tokens, kv), steps.duration)
    assert free.intercept_ < 0  # what a free intercept makes of these rows
    fitted = fit_model(c.DECODE_STEP, steps, steps.duration, FitConfig())
    assert fitted.intercept == 0.0
    assert all(x >= 0 for x in fitted.coefficients) and fitted.coefficients[-1] > 0


def test_show_prints_what_a_profile_is_of_and_each_models_held_out_mape(
    fitted: FitResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    write_profile(fitted.profile, path)
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out.splitlines()
    p = fitted.profile
    assert shown[:4] == ["fitted", f"  model     {p.model}", f"  hardware  {p.hardware}", "  source    measured"]
    rows = {line.split()[0]: line.split()[1:] for line in shown[6:]}
    for name, model in ((c.DECODE_STEP, p.decode), (c.PREFILL_STEP, p.prefill), (c.MIXED_INCREMENT, p.mixed)):
        assert rows[name] == [str(model.samples), f"{100 * model.mape:.2f}%"], name
    assert rows[c.KV_TRANSFER] == ["-", "-", "copied", "from", TRUTH.name]  # no transfers among the records
    assert main(["show", "deepseek-v2-lite-a100"]) == 0
    assert "  source    not measured (calibrated)" in capsys.readouterr().out
    assert main(["show", "no-such-profile"]) == 2
    assert "unknown profile 'no-such-profile'" in capsys.readouterr().err
