"""The discrete-event simulator: exact timings on tiny scenarios, and properties of short runs."""

from __future__ import annotations

import pytest

from kairos.core.decision import Decision, Route
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.requests import RequestSpec
from kairos.traffic.workloads import make_workload
from tests.builders import make_models

MODELS = load_profile()


def simulate(requests: list[RequestSpec], spec: str, **cluster: object) -> Simulator:
    sim = Simulator(requests, create_policy(spec, MODELS), MODELS, ClusterConfig(**cluster))  # type: ignore[arg-type]
    sim.run()
    return sim


def test_keep_path_ttft_is_prefill_plus_transfer_plus_first_decode_step() -> None:
    sim = simulate([RequestSpec("r", 0.0, 1000, 3)], "pd")
    (rec,) = sim.metrics.records
    prefill = 0.040 + 1e-5 * 1000  # one 1000-token step on an idle prefill node
    transfer = 0.005 + 1000 * 31104 / 1e9
    first_decode = 0.046 + 1.5e-4 * 1 + 1.55e-8 * 1000  # B = 1, K = the transferred prompt
    assert rec.ttft == pytest.approx(prefill + transfer + first_decode)
    assert rec.ttft_parts() == pytest.approx((0.0, prefill, transfer, first_decode))
    assert rec.prefill_node == "p0" and rec.decode_node == "d0"
    assert sim.metrics.summary["deflections"] == 0
    # the keep path's estimate has every one of those parts: exact on an idle cluster
    assert rec.predicted_ttft_s == pytest.approx(rec.ttft)
    assert sim.metrics.summary["ttft_prediction_mape_keep"] == pytest.approx(0.0, abs=1e-12)


def test_eq1_alone_misses_the_transfer_and_the_first_decode_step() -> None:
    sim = simulate([RequestSpec("r", 0.0, 1000, 3)], "kairos:keep=eq1")
    (rec,) = sim.metrics.records
    assert rec.predicted_ttft_s == pytest.approx(rec.ttft_parts()[1])  # the prefill alone
    summary = sim.metrics.summary
    assert summary["ttft_prediction_mape_keep"] == pytest.approx(1 - rec.predicted_ttft_s / rec.ttft)
    assert summary["ttft_prediction_bias_keep"] == pytest.approx(-summary["ttft_prediction_mape_keep"])
    assert summary["ttft_prediction_mape_deflect"] == 0.0  # no deflection


def test_decode_heartbeats_report_the_kv_pulls_on_their_link() -> None:
    """With a 1 MB/s link (1 s per 1000 tokens), two keeps prefilled at once on p0 and p1 head
    for d0: from 0.100 the 900-token one transfers, the 1000-token one (done at 0.110) queues
    behind it, and d0's heartbeat at 0.2 shows both, in link order."""
    models = make_models()  # prefill step 0.010 + 1e-4 n; T_xfer(n) = 0.001 + n / 1000
    seen: list[tuple[int, ...]] = []
    pd = create_policy("pd", models)

    class Watching:
        label, fresh_state = "watching", False

        def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
            seen.append(view.decode[0].pending_kv_pull_tokens)
            return pd.decide(prompt_tokens, view, now)

    requests = [RequestSpec("a", 0.0, 1000, 2), RequestSpec("b", 0.0, 900, 2), RequestSpec("probe", 0.25, 10, 2)]
    Simulator(requests, Watching(), models, ClusterConfig(prefill_nodes=2, decode_nodes=1)).run()  # type: ignore[arg-type]
    assert seen == [(), (), (900, 1000)]


def test_a_deflected_request_prefills_in_place_with_its_schedule() -> None:
    # Four 30K-token prompts fill both prefill queues (too long to deflect within the TTFT SLO);
    # the short probe behind them is faster on an idle decode node.
    burst = [RequestSpec(f"b{i}", 0.0, 30000, 2) for i in range(4)]
    probe = RequestSpec("probe", 0.01, 600, 4)
    sim = simulate([*burst, probe], "kairos")
    rec = next(r for r in sim.metrics.records if r.spec.request_id == "probe")
    assert rec.route.value == "deflect" and rec.prefill_node is None
    assert rec.transfer_start is None  # no KV transfer on the deflect path
    # An idle decode node (B = 0, K = 0): the whole 600-token prompt fits one 2048-token step.
    assert rec.seq is not None and rec.seq.first_decode_step == 0
    assert rec.ttft == pytest.approx(MODELS.mixed_step_s(600, 0, 0, 0))


def test_pd_never_deflects_and_every_request_finishes() -> None:
    reqs = make_workload("bursty", rps=4, duration_s=60, seed=3)
    sim = simulate(reqs, "pd")
    s = sim.metrics.summary
    assert s["requests"] == len(reqs) and s["deflections"] == 0
    assert all(r.finished is not None and r.first_token is not None for r in sim.metrics.records)


def test_kairos_keeps_every_step_within_tau_when_truth_equals_the_model() -> None:
    reqs = make_workload("bursty", rps=8, duration_s=120, seed=5)
    s = simulate(reqs, "kairos:alpha=1.3").metrics.summary
    assert s["deflections"] > 0
    assert s["tbt_violation_rate"] == 0.0 and s["max_tbt_ms"] <= 70.0 + 1e-9


@pytest.mark.parametrize("rule", ["offload", "fastest"])
def test_a_split_prefills_its_first_k_on_the_prefill_node_and_the_rest_on_the_decode_node(rule: str) -> None:
    reqs = make_workload("bursty", rps=7, duration_s=120, seed=5)
    sim = simulate(reqs, f"kairos:split={rule}")
    s = sim.metrics.summary
    splits = [r for r in sim.metrics.records if r.route is Route.SPLIT]
    assert s["splits"] == len(splits) > 0
    assert s["tbt_violation_rate"] == 0.0 and s["max_tbt_ms"] <= 70.0 + 1e-9  # truth = model
    for r in splits:
        assert r.prefill_seq is not None and r.prefill_seq.prompt_tokens == r.split_tokens  # k on the prefill node
        assert 0 < r.transfer_tokens <= r.split_tokens < r.spec.prompt_tokens  # at most k pulled
        assert sum(r.schedule) == r.spec.prompt_tokens - r.split_tokens
        assert r.transfer_end is not None and r.first_token is not None and r.first_token > r.transfer_end
        assert r.finished is not None and r.seq is not None and r.seq.generated == r.spec.output_tokens
    off = simulate(reqs, "kairos:split=off").metrics.summary
    assert off["splits"] == 0 and off["requests"] == s["requests"]


def test_without_the_node_guard_stale_state_can_break_tbt() -> None:
    """Decodes join a node between the decision and a deflection's steps; with neither the
    node's guard nor a plan beside the decodes whose KV it is pulling, a step can run past tau."""
    reqs = make_workload("bursty", rps=8, duration_s=120, seed=5)
    s = simulate(reqs, "kairos:alpha=1.3,guard=off,pulls=off").metrics.summary
    assert s["max_tbt_ms"] > 70.0


def test_a_plan_beside_the_pulled_decodes_breaks_tbt_less_without_the_guard() -> None:
    """The same scene with plans beside the decodes whose KV the node is pulling (the default):
    fewer steps of deflected chunks run past tau, even without the node's guard to shrink them."""
    reqs = make_workload("bursty", rps=8, duration_s=120, seed=5)
    pulls = simulate(reqs, "kairos:alpha=1.3,guard=off").metrics.summary
    alone = simulate(reqs, "kairos:alpha=1.3,guard=off,pulls=off").metrics.summary
    assert pulls["deflections"] > 0
    assert pulls["tbt_violation_rate"] < alone["tbt_violation_rate"]


def test_runs_are_deterministic_for_a_seed_and_the_error_option_changes_them() -> None:
    reqs = make_workload("bursty", rps=6, duration_s=60, seed=7)
    a = simulate(reqs, "kairos").metrics.summary
    b = simulate(reqs, "kairos").metrics.summary
    noisy = simulate(reqs, "kairos", error=0.1, seed=1).metrics.summary
    assert a == b
    assert noisy["p50_tbt_ms"] != a["p50_tbt_ms"]


def test_oracle_and_lifted_limit_deflect_at_least_as_often_as_the_paper_rule() -> None:
    reqs = make_workload("bursty", rps=6, duration_s=120, seed=2)
    one = simulate(reqs, "kairos:pending=1").metrics.summary["deflections"]
    lifted = simulate(reqs, "kairos").metrics.summary["deflections"]
    oracle = simulate(reqs, "oracle").metrics.summary["deflections"]
    assert lifted > one and oracle > one


@pytest.mark.parametrize("spec", ["llmd", "dynamo"])
def test_cache_blind_anchor_defaults_route_bursty_exactly_as_pd(spec: str) -> None:
    """Without a prefix cache every Bursty prompt has >= 16 uncached tokens (llm-d disaggregates)
    and an effective/raw ratio of 1 (Dynamo's isl_bounding never bypasses): both are P/D."""
    reqs = make_workload("bursty", rps=6, duration_s=60, seed=1)
    assert min(r.prompt_tokens for r in reqs) >= 16
    anchor, pd = simulate(reqs, spec), simulate(reqs, "pd")
    assert anchor.metrics.summary["deflections"] == 0
    assert [r.ttft for r in anchor.metrics.records] == [r.ttft for r in pd.metrics.records]


@pytest.mark.parametrize("spec", ["llmd:threshold=4096", "dynamo:mode=either", "aibrix"])
def test_anchor_deciders_prefill_on_decode_nodes_and_finish_every_request(spec: str) -> None:
    reqs = make_workload("bursty", rps=6, duration_s=60, seed=1)
    sim = simulate(reqs, spec)
    s = sim.metrics.summary
    assert s["requests"] == len(reqs) and 0 < s["deflections"] < len(reqs)
    assert all(r.finished is not None and r.first_token is not None for r in sim.metrics.records)
    deflected = [r for r in sim.metrics.records if r.route.value == "deflect"]
    assert len(deflected) == s["deflections"]
    assert all(r.prefill_node is None and r.transfer_start is None for r in deflected)


class _CountingTracker(ClusterTracker):
    def __init__(self) -> None:
        super().__init__()
        self.reports = 0

    def update_prefill(self, state: PrefillNodeState) -> None:
        self.reports += 1
        super().update_prefill(state)

    def update_decode(self, state: DecodeNodeState) -> None:
        self.reports += 1
        super().update_decode(state)


def test_heartbeat_work_follows_the_requests_not_the_simulated_time() -> None:
    """Only a decision reads a heartbeat, and a node's next one replaces it: a run reports at
    most once per node per request (plus registration), however long the run, while every
    decision still reads each node's last beat before it."""
    spaced = [RequestSpec(f"r{i}", 50.0 + 50.0 * i, 800 + 100 * i, 20) for i in range(6)]  # 500 beats apart
    policy = create_policy("kairos", MODELS)
    ages: list[float] = []

    class Watching:
        label, fresh_state = policy.label, policy.fresh_state

        def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
            ages.extend(now - n.reported_at for n in (*view.prefill, *view.decode))
            return policy.decide(prompt_tokens, view, now)

    sim = Simulator(spaced, Watching(), MODELS)
    sim.tracker = tracker = _CountingTracker()
    sim.run()
    assert tracker.reports <= len(sim.engines) * (len(spaced) + 1)
    assert len(ages) == len(sim.engines) * len(spaced)
    assert all(0 <= age < sim.cluster.heartbeat_s for age in ages)


def test_the_correlated_error_form_is_seeded_and_differs_from_the_iid_one() -> None:
    reqs = make_workload("bursty", rps=6, duration_s=60, seed=7)
    a = simulate(reqs, "kairos", error=0.1, seed=1, error_form="correlated").metrics.summary
    b = simulate(reqs, "kairos", error=0.1, seed=1, error_form="correlated").metrics.summary
    other_seed = simulate(reqs, "kairos", error=0.1, seed=2, error_form="correlated").metrics.summary
    iid = simulate(reqs, "kairos", error=0.1, seed=1).metrics.summary
    assert a == b
    assert a["p50_tbt_ms"] != iid["p50_tbt_ms"] and a["p50_tbt_ms"] != other_seed["p50_tbt_ms"]
    with pytest.raises(ValueError, match="error_form"):
        ClusterConfig(error_form="gaussian")


def test_correlated_timers_give_each_node_its_own_bias() -> None:
    from kairos.sim.simulator import correlated_timers

    timers = correlated_timers(lambda role, plan: 1.0, 0.1, 3, ("d0", "d1"), bias_share=1.0)  # no noise
    (d0, d1) = (timers["d0"](None, None), timers["d1"](None, None))  # type: ignore[arg-type]
    assert d0 != d1
    assert [timers["d0"](None, None) for _ in range(3)] == [d0] * 3  # type: ignore[arg-type]


def test_decode_nodes_calibrate_to_exactly_one_on_an_exact_model_and_above_it_with_error() -> None:
    reqs = make_workload("bursty", rps=8, duration_s=120, seed=5)
    exact = simulate(reqs, "kairos")
    assert all(e.calibration is not None and e.calibration.value == 1.0 for e in exact.decode)
    # The same decisions as a dispatcher that ignores the calibration (1.0 is the paper's Eq. 5).
    assert simulate(reqs, "kairos:calibrate=off").metrics.summary == exact.metrics.summary
    noisy = simulate(reqs, "kairos", error=0.1, seed=1)
    # i.i.d. normal errors with MAE 0.1: the 99th percentile of the ratio is 1 + 2.326 x 0.1253 = 1.29.
    assert all(1.2 < e.calibration.value < 1.4 for e in noisy.decode if e.calibration is not None)
    # Planned to tau / 1.29, the deflected steps stay under tau where the uncalibrated plan breaks it.
    calibrated = noisy.metrics.summary["tbt_violation_rate"]
    uncalibrated = simulate(reqs, "kairos:calibrate=off", error=0.1, seed=1).metrics.summary["tbt_violation_rate"]
    assert calibrated < 0.01 < uncalibrated
