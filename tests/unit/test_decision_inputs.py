"""The inputs of a decision are the ones Algorithm 1 needs (issue 32's audit of the decision core):
each case here failed on the code before its fix, with the numbers the audit gave.

1. A queued or half-done deflection is planned over its own computed prefix.
2. KV transfers in flight count in the load measures (keep-path pick, overload, pressure, KV room).
3. A profile predicting a non-positive or non-monotone step time over the operating range is refused.
4. Eq. 7 compares estimates built alike: a deflection starts at the decode node's next step.
5. Degraded mode (no prefill node) deflects within the normal path's bounds, else a clear 503.
6. A decode node's step guard counts every token of the step; a keep carries its decode node's
   step budget, for a local prefill should its prefill node fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

import kairos.core
from kairos.common.contracts import (
    HeartbeatField,
    MalformedHeartbeat,
    Role,
    encode_engine_state,
    encode_heartbeat,
    parse_engine_state,
    parse_heartbeat,
)
from kairos.common.errors import NoHealthyNodeError, ProfileError
from kairos.core import algorithm as alg
from kairos.core.algorithm import DeciderConfig, greedy_schedule, plan_on_decode_node
from kairos.core.algorithm.bounds import plan_on_path
from kairos.core.algorithm.schedule import Plan
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import StepGuard, load_profile, parse_profile
from kairos.core.policies import create_policy
from kairos.core.state import DecodeNodeState, IncomingLink, PrefillNodeState, prompt_attention_tokens
from kairos.core.view import ClusterTracker
from kairos.extproc.membership import Membership, MembershipConfig
from kairos.nodeagent.vllm_plugin.engine_state import PendingPrefill, build_state
from kairos.profiling.__main__ import main as profile_main
from kairos.sim.engine import Engine, EngineConfig, Sequence, model_step_time
from kairos.sim.simulator import _decode_state, _Link
from tests.builders import BIG_KV, decode_node, flat_models, make_models, models_dict, prefill_node, view
from tests.builders import heartbeat_json as beat

PACKAGED = load_profile()
UNLIMITED = DeciderConfig(max_pending_deflections=None)  # deflections queue behind a node's backlog


# ---------------------------------------------------------------------------------------------
# 1. A queued deflection's computed prefix
# ---------------------------------------------------------------------------------------------
def _half_done_node(**changes: object) -> DecodeNodeState:
    """The audit's node: B = 15, K = 60K, with a 12K-token deflection half prefilled (its 6K
    computed tokens are part of K)."""
    fields: dict[str, object] = {
        "decode_tokens": 15,
        "kv_tokens": 60_000,
        "kv_capacity_tokens": BIG_KV,
        "reported_at": 0.0,
        "prefill_backlog_tokens": (6000,),
        "prefill_backlog_computed_tokens": (6000,),
        **changes,
    }
    return DecodeNodeState("d1", **fields)  # type: ignore[arg-type]


def test_a_half_done_deflection_is_planned_over_its_computed_prefix() -> None:
    """Its remaining 6K tokens attend to the 6K already computed: the backlog takes the greedy
    over cached 6K..12K (K without its own prefix, which the greedy adds back), not over 0..6K,
    and a 2K request queued behind it starts that much later."""
    node = _half_done_node()
    cands, budget = UNLIMITED.chunk_candidates, UNLIMITED.step_budget_s
    with_prefix = greedy_schedule(PACKAGED, 12_000, 15, 54_000, cands, budget, cached_tokens=6000)
    from_nothing = greedy_schedule(PACKAGED, 6000, 15, 60_000, cands, budget)
    assert not isinstance(with_prefix, str) and not isinstance(from_nothing, str)
    backlog_s = with_prefix[1]
    assert (round(from_nothing[1], 2), round(backlog_s, 2)) == (1.30, 2.65)  # the audit's figures
    # (from the middle of the head's running step: finding 4)
    own = greedy_schedule(PACKAGED, 2000, 16, 66_000, cands, budget, start_s=backlog_s - 0.5 * with_prefix[0][0][2])
    assert not isinstance(own, str)
    plan = plan_on_decode_node(PACKAGED, UNLIMITED, node, 2000, math.inf)
    assert isinstance(plan, Plan)
    assert plan.ttft_s == pytest.approx(own[1], rel=1e-12)
    assert plan.ttft_s - own[1] + backlog_s - from_nothing[1] > 1.3  # 1.35 s the old plan left out
    # The bounded search's path for the node starts after the same backlog.
    assert plan_on_path(PACKAGED, UNLIMITED, node, 2000, math.inf) == plan


def test_a_backlog_without_computed_prefixes_is_planned_as_before() -> None:
    """A node (or heartbeat) that reports no computed prefix: every backlog prefill from nothing."""
    reported = _half_done_node(prefill_backlog_computed_tokens=())
    zero = _half_done_node(prefill_backlog_computed_tokens=(0,))
    a = plan_on_decode_node(PACKAGED, UNLIMITED, reported, 2000, math.inf)
    b = plan_on_decode_node(PACKAGED, UNLIMITED, zero, 2000, math.inf)
    assert isinstance(a, Plan) and a == b


def test_a_state_with_more_computed_prefixes_than_backlog_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_backlog_computed_tokens"):
        _half_done_node(prefill_backlog_computed_tokens=(6000, 0))


def test_the_engine_reports_each_deflections_computed_prefix_and_the_simulator_passes_it_on() -> None:
    models = PACKAGED
    engine = Engine(EngineConfig("d1", Role.DECODE), model_step_time(models), models)
    running = Sequence("r1", 3000, 2, schedule=(1000,))
    queued = Sequence("r2", 500, 2, schedule=(500,))
    engine.submit(running)
    engine.submit(queued)
    plan = engine.plan_step(0.0)
    assert plan is not None
    engine.finish_step(plan, 0.1, 0.1)  # r1's first 1000 tokens; r2 waits (one deflection at a time)
    snap = engine.snapshot()
    assert (snap.scheduled_prefill_tokens, snap.scheduled_prefill_computed_tokens) == ((2000, 500), (1000, 0))
    state = _decode_state(snap, 0.1, _Link())
    assert (state.prefill_backlog_tokens, state.prefill_backlog_computed_tokens) == ((2000, 500), (1000, 0))


def test_the_heartbeat_carries_each_deflections_computed_prefix_into_the_view() -> None:
    raw = beat("d0", decode_tokens=15, kv_tokens=60_000, scheduled_prefill_tokens=[6000, 300])
    assert parse_heartbeat(raw, "d0").scheduled_prefill_computed_tokens is None  # an older node's beat
    with_prefix = json.loads(raw) | {HeartbeatField.SCHEDULED_PREFILL_COMPUTED_TOKENS: [6000, 0]}
    hb = parse_heartbeat(json.dumps(with_prefix), "d0")
    assert hb.scheduled_prefill_computed_tokens == (6000, 0)
    assert parse_heartbeat(encode_heartbeat(hb), "d0") == hb
    m = Membership(MembershipConfig())
    older = beat("d1", decode_tokens=15, kv_tokens=60_000, scheduled_prefill_tokens=[6000, 300])
    m.poll_succeeded([("d0", json.dumps(with_prefix)), ("d1", older)], 5.0)
    by_id = {n.node_id: n for n in m.tracker.view().decode}
    assert by_id["d0"].prefill_backlog_computed_tokens == (6000, 0)
    assert by_id["d1"].prefill_backlog_computed_tokens == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([6000], "scheduled_prefill_computed_tokens has 1 entries for 2 scheduled prefills"),
        ([6000, -1], "scheduled_prefill_computed_tokens must be a list of ints >= 0"),
        (7, "scheduled_prefill_computed_tokens must be a list of ints >= 0"),
    ],
)
def test_a_heartbeat_with_malformed_computed_prefixes_is_refused(value: object, message: str) -> None:
    raw = json.loads(beat("d0", scheduled_prefill_tokens=[6000, 300]))
    raw[HeartbeatField.SCHEDULED_PREFILL_COMPUTED_TOKENS] = value
    with pytest.raises(MalformedHeartbeat, match=message):
        parse_heartbeat(json.dumps(raw), "d0")


def test_a_deflection_dispatched_since_the_heartbeat_shows_its_cached_prefix() -> None:
    """The overlay holds a deflection's uncached work as its backlog entry and its cached prefix
    as computed, held in K from then on (the node pins those blocks for it)."""
    tracker = ClusterTracker()
    tracker.update_decode(decode_node("d1", b=3, k=9000, backlog=(200,)))
    sent = Decision(Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, "d1", None, (700,), 1.0, 0.5, 1000, cached_tokens=300)
    tracker.record(sent, 0.05)
    (d1,) = tracker.view().decode
    assert (d1.prefill_backlog_tokens, d1.prefill_backlog_computed_tokens) == ((200, 700), (0, 300))
    assert d1.kv_tokens == 9300


def test_replace_keeps_the_computed_prefixes() -> None:
    node = _half_done_node()
    assert dataclasses.replace(node, decode_tokens=3).prefill_backlog_computed_tokens == (6000,)


def test_the_vllm_plugins_state_carries_each_deflections_computed_prefix() -> None:
    state = build_state(
        decode_tokens=15,
        kv_tokens=60_000,
        kv_capacity_tokens=BIG_KV,
        prefills=[
            PendingPrefill(6000, True, 6000),  # running, half done
            PendingPrefill(900, False, 100),  # an unscheduled prefill: not a deflection
            PendingPrefill(1200, True, 800),  # waiting, from its prefix hit
            PendingPrefill(0, True, 500),  # done: not pending
        ],
        max_step_tokens=4096,
        model="m",
        running_requests=17,
        waiting_requests=1,
        kv_usage=0.05,
    )
    assert (state.scheduled_prefill_tokens, state.scheduled_prefill_computed_tokens) == ((6000, 1200), (6000, 800))
    assert parse_engine_state(encode_engine_state(state)) == state


# ---------------------------------------------------------------------------------------------
# 2. KV transfers in flight
# ---------------------------------------------------------------------------------------------
ROUND = make_models()  # T0(B, K) = 0.040 + 0.001 B: the overload line (70 ms) is at B = 30


def _pulling(node_id: str, b: int, pulls: tuple[int, ...], **changes: object) -> DecodeNodeState:
    return dataclasses.replace(decode_node(node_id, b=b, k=b * 1000), pending_kv_pull_tokens=pulls, **changes)


def test_the_keep_path_does_not_pick_a_node_about_to_hold_fifty_decodes() -> None:
    """d0 runs 20 decodes with 30 transfers landing, d1 runs 21: d0's next steps hold 50."""
    d0, d1 = _pulling("d0", 20, (1000,) * 30), decode_node("d1", b=21, k=21_000)
    assert alg.decode_load_s(ROUND, d0) == pytest.approx(0.040 + 0.001 * 50)
    assert alg.decode_load_after_s(ROUND, d0, 500) == pytest.approx(0.040 + 0.001 * 51)
    keep = alg.pick_keep_decode_node(ROUND, view((prefill_node(),), (d0, d1)), 0.0, DeciderConfig(), 500)
    assert keep.node_id == "d1"


def test_the_overload_line_sees_the_decodes_a_node_is_pulling() -> None:
    """B = 20 is under the line, B = 20 + 30 landing is over it: no deflection to d0."""
    prefill = prefill_node("p1", queue=(20_000,), chunk=1000)  # 2.2 s of queue: the gate is open
    d = alg.decide(500, view((prefill,), (_pulling("d0", 20, (1000,) * 30),)), 0.0, ROUND, DeciderConfig())
    assert (d.route, d.reason) == (Route.KEEP, Reason.KEEP_DECODE_OVERLOADED)


def test_the_pressure_rule_sees_the_decodes_a_node_is_pulling() -> None:
    """Its line is 0.85 x 70 ms = 59.5 ms: B = 11 with the request (51 ms) is under it, B = 23 with
    12 transfers landing (63 ms) over it."""
    cfg = DeciderConfig()
    refuses = alg.decode_pressure_refusal(ROUND, cfg, 500, ttft_pf=2.0)
    assert refuses is not None
    assert not refuses(decode_node("d0", b=10, k=10_000))
    assert refuses(_pulling("d0", 10, (1000,) * 12))


def test_a_nodes_free_kv_leaves_room_for_the_transfers_it_is_pulling() -> None:
    node = _pulling("d0", 10, (30_000, 15_000), kv_tokens=50_000, kv_capacity_tokens=100_000)
    assert node.free_kv_tokens == 5000
    assert not alg.can_take_deflection(node, 0.0, DeciderConfig(), 6000)


def test_the_vllm_plugin_reports_the_kv_it_is_pulling() -> None:
    """Requests whose KV arrives from a prefill node (waiting for remote KVs, or queued to be):
    one entry per transfer, their prompt tokens, in queue order."""
    state = build_state(
        decode_tokens=4,
        kv_tokens=4000,
        kv_capacity_tokens=BIG_KV,
        prefills=[],
        max_step_tokens=4096,
        model="m",
        running_requests=4,
        waiting_requests=2,
        kv_usage=0.01,
        kv_pulls=(3000, 1200),
    )
    assert state.pending_kv_pull_tokens == (3000, 1200)
    assert parse_engine_state(encode_engine_state(state)).pending_kv_pull_tokens == (3000, 1200)


# ---------------------------------------------------------------------------------------------
# 3. Profiles that predict impossible steps
# ---------------------------------------------------------------------------------------------
def _profile_text(**overrides: float) -> str:
    return json.dumps(models_dict(**overrides))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(
            {"mixed_b0": -0.2},
            [
                "mixed_increment",
                "a 1-token chunk makes the step faster than its decodes alone",
                "B = 0 decodes, K = 0 KV tokens, a 1-token chunk over 0 cached tokens",
                "(-0.2 s)",
                "intercept = -0.2",
            ],
            id="the audit's negative mixed intercept",
        ),
        pytest.param(
            {"mixed_p_x_b": -1e-6},
            [
                "mixed_increment",
                "falls as the chunk's prefill tokens grow",
                "B = 256 decodes",
                "prefill_tokens_x_decode_tokens = -1e-06",
            ],
            id="chunks cheaper beside many decodes",
        ),
        pytest.param(
            {"decode_per_k": -1e-7},
            ["decode_step", "falls as the KV tokens grow", "kv_tokens = -1e-07"],
            id="a decode step cheaper with more KV",
        ),
        pytest.param(
            {"prefill_x_cached": -1e-8},
            ["prefill_step", "falls as the cached tokens grow", "tokens_x_cached = -1e-08"],
            id="prefill cheaper over a longer prefix",
        ),
        pytest.param(
            {"mixed_over_knee": -1e-3, "mixed_knee": 2000.0},
            ["mixed_increment", "falls as the chunk's prefill tokens grow", "step_tokens_over_knee = -0.001"],
            id="a negative slope past the knee",
        ),
        pytest.param(
            {"decode_b0": 0.0, "decode_per_b": 0.0},
            ["decode_step", "a step with B = 1 decodes, K = 1 KV tokens is predicted to take 0 s", "must be > 0"],
            id="a free decode step",
        ),
        pytest.param(
            {"decode_b0": -0.0005},
            ["mixed_increment", "B = 0 decodes", "is predicted to take -0.0004 s", "decode_step intercept = -0.0005"],
            id="a prefill on an idle decode node that takes no time",
        ),
    ],
)
def test_a_profile_predicting_an_impossible_step_is_refused(overrides: dict[str, float], expected: list[str]) -> None:
    with pytest.raises(ProfileError) as info:
        parse_profile(_profile_text(**overrides), "bad.json")
    for text in ["bad.json", *expected]:
        assert text in info.value.message


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="the builders' round profile"),
        pytest.param({"mixed_p_x_b": -1e-8}, id="a negative interaction the chunk term outweighs up to B = 256"),
    ],
)
def test_a_profile_positive_and_monotone_over_the_range_is_taken(overrides: dict[str, float]) -> None:
    parse_profile(_profile_text(**overrides), "ok.json")


def test_the_packaged_profiles_pass() -> None:
    profiles = Path(kairos.core.__file__).parent / "profiles"
    names = sorted(p.stem for p in profiles.glob("*.json"))
    assert names
    for name in names:
        load_profile(name)


def _collection(root: Path, truth: Any) -> list[str]:
    from kairos.profiling.plan import PlanConfig, plan_phases
    from tests.synthetic_runs import write_runs

    write_runs(root / "p0", plan_phases(PlanConfig(role="prefill", rates=(1.0, 4.0), duration_s=20)), "prefill", truth)
    decode = PlanConfig(role="decode", rates=(1.0, 4.0), duration_s=20, batch_sizes=(4, 16, 32))
    write_runs(root / "d0", plan_phases(decode), "decode", truth)
    return [str(root / "p0"), str(root / "d0")]


def test_fit_allow_negative_writes_a_profile_valid_over_the_range(tmp_path: Path) -> None:
    truth = make_models(mixed_p_x_b=-1e-8, mixed_per_p=1e-4)
    out = tmp_path / "neg.json"
    assert profile_main(["fit", *_collection(tmp_path, truth), "--out", str(out), "--allow-negative"]) == 0
    assert load_profile(out).mixed.coef("prefill_tokens_x_decode_tokens") < 0


def test_fit_allow_negative_refuses_to_write_a_profile_invalid_over_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records whose chunks get cheaper with the batch (fine up to B = 32, where they were
    measured; negative steps by B = 256): the fit says which coefficient and where, and writes nothing."""
    truth = make_models(mixed_p_x_b=-1e-6, mixed_per_p=1e-4)
    out = tmp_path / "neg.json"
    assert profile_main(["fit", *_collection(tmp_path, truth), "--out", str(out), "--allow-negative"]) == 2
    err = capsys.readouterr().err
    assert "prefill_tokens_x_decode_tokens" in err and "B = 256 decodes" in err and "--allow-negative" in err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# 4. A deflected request starts at the decode node's next step
# ---------------------------------------------------------------------------------------------
def test_a_deflection_waits_for_the_step_the_node_is_running() -> None:
    """The engine admits a request at its next step: half of the running decode-only step on
    average, as the keep path's estimate already counts at its join (about 24 ms at B = 20)."""
    node = decode_node("d1", b=20, k=20 * 3569)
    running = PACKAGED.decode_step_s(20, 20 * 3569)
    own = greedy_schedule(PACKAGED, 3000, 20, 20 * 3569, UNLIMITED.chunk_candidates, UNLIMITED.step_budget_s)
    assert not isinstance(own, str)
    plan = plan_on_decode_node(PACKAGED, UNLIMITED, node, 3000, math.inf)
    assert isinstance(plan, Plan)
    assert round(0.5 * running, 4) == 0.0251
    assert plan.ttft_s == pytest.approx(0.5 * running + own[1], rel=1e-12)
    assert plan_on_path(PACKAGED, UNLIMITED, node, 3000, math.inf) == plan
    assert alg.ttft_lower_bound_s(PACKAGED, UNLIMITED, node, 3000) <= plan.ttft_s * (1 + 1e-9)


def test_a_deflection_on_an_idle_node_starts_at_once() -> None:
    plan = plan_on_decode_node(PACKAGED, UNLIMITED, decode_node("d1"), 3000, math.inf)
    own = greedy_schedule(PACKAGED, 3000, 0, 0, UNLIMITED.chunk_candidates, UNLIMITED.step_budget_s)
    assert isinstance(plan, Plan) and not isinstance(own, str)
    assert plan.ttft_s == own[1]


def test_a_backlog_runs_from_the_middle_of_its_running_step() -> None:
    """The backlog's head is the prefill the node runs now: its remaining tokens include the
    running chunk, half done on average."""
    node = _half_done_node()
    cands, budget = UNLIMITED.chunk_candidates, UNLIMITED.step_budget_s
    backlog = greedy_schedule(PACKAGED, 12_000, 15, 54_000, cands, budget, cached_tokens=6000)
    assert not isinstance(backlog, str)
    first_step = backlog[0][0][2]
    own = greedy_schedule(PACKAGED, 2000, 16, 66_000, cands, budget, start_s=backlog[1] - 0.5 * first_step)
    assert not isinstance(own, str)
    plan = plan_on_decode_node(PACKAGED, UNLIMITED, node, 2000, math.inf)
    assert isinstance(plan, Plan) and plan.ttft_s == pytest.approx(own[1], rel=1e-12)


def test_eq7_no_longer_deflects_on_the_half_step_it_left_out() -> None:
    """A keep path whose estimate lies between the deflection's TTFT from t = 0 and from the
    node's next step: alpha = 1 kept it only once both estimates start where the engine does."""
    cfg = DeciderConfig(deflect_gate_share=None, decode_pressure_share=None)
    node = decode_node("d1", b=20, k=20 * 3569)
    own = greedy_schedule(PACKAGED, 3000, 20, 20 * 3569, cfg.chunk_candidates, cfg.step_budget_s)
    assert not isinstance(own, str)
    half = 0.5 * PACKAGED.decode_step_s(20, 20 * 3569)

    def keep_ttft(queue: int) -> float:
        p = prefill_node("p1", queue=(queue,) if queue else (), chunk=2048)
        _, prefill_s = alg.best_prefill_node(PACKAGED, view((p,), (node,)), 0.0, cfg, 3000)
        return alg.keep_ttft_s(PACKAGED, cfg, prefill_s, node, 3000)

    lo, hi = 0, 200_000  # the queue whose keep estimate lands halfway through the half step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if keep_ttft(mid) < own[1] + half / 2 else (lo, mid)
    assert own[1] < keep_ttft(hi) < own[1] + half
    d = alg.decide(3000, view((prefill_node("p1", queue=(hi,), chunk=2048),), (node,)), 0.0, PACKAGED, cfg)
    assert (d.route, d.reason) == (Route.KEEP, Reason.KEEP_DECODE_SLOWER)


# ---------------------------------------------------------------------------------------------
# 5. Degraded mode: the normal path's bounds
# ---------------------------------------------------------------------------------------------
# Flat models, tau = 0.105, candidates (420, 220, 120), as test_algorithm's tables: a 1000-token
# prompt takes 0.250 s on B = 10, 0.280 s on B = 20, each after half the node's running step
# (0.025, 0.030); B = 70's decode-only step (0.110 s) is over the line.
FLAT = flat_models()
TABLE = DeciderConfig(chunk_candidates=(420, 220, 120), tbt_slo_s=0.105)


def test_degraded_mode_refuses_a_prompt_no_node_can_prefill_in_time() -> None:
    """An idle node and a 32K prompt on the packaged profile: its chunks shrink with the prefix
    (past about 17K cached tokens not even a 128-token step fits the budget) and the schedule
    runs past the SLO. Before: 250 steps of 128 tokens, about 21 s."""
    with pytest.raises(NoHealthyNodeError, match=r"32000-token prompt.*within the TTFT SLO \(4 s\)"):
        alg.decide_without_prefill_pool(32_000, view((), (decode_node("d1"),)), 0.0, PACKAGED, DeciderConfig())


def test_degraded_mode_refuses_a_node_with_no_tbt_safe_schedule() -> None:
    """B = 64: T0 0.104 is under tau, but the smallest candidate's 56 prefill tokens make 0.1096."""
    with pytest.raises(NoHealthyNodeError, match="no decode node has a TBT-safe schedule for it"):
        alg.decide_without_prefill_pool(1000, view((), (decode_node("d1", b=64),)), 0.0, FLAT, TABLE)


def test_degraded_mode_refuses_a_schedule_past_the_ttft_slo() -> None:
    """The B20 node's schedule (0.310 s) is TBT-safe but over a 0.3 s SLO: Eq. 7's second
    clause, as on the normal path. Before: deflected with no time bound."""
    node = (decode_node("d1", b=20),)
    with pytest.raises(NoHealthyNodeError, match=r"within the TTFT SLO \(0.3 s\)"):
        alg.decide_without_prefill_pool(1000, view((), node), 0.0, FLAT, dataclasses.replace(TABLE, ttft_slo_s=0.3))
    d = alg.decide_without_prefill_pool(1000, view((), node), 0.0, FLAT, dataclasses.replace(TABLE, ttft_slo_s=0.32))
    assert (d.route, d.reason, d.chunk_sizes) == (Route.DEFLECT, Reason.DEFLECT_NO_PREFILL_NODE, (400, 400, 200))
    assert d.predicted_ttft_decode_s == pytest.approx(0.310)


def test_degraded_mode_leaves_an_overloaded_node_alone() -> None:
    """B = 70: its decode-only step is over the line. Before: the smallest candidate (120
    tokens, as prompt tokens beside 70 decodes) went there anyway, unbounded."""
    with pytest.raises(NoHealthyNodeError, match="over its overload line"):
        alg.decide_without_prefill_pool(500, view((), (decode_node("d1", b=70),)), 0.0, FLAT, TABLE)


def test_degraded_mode_needs_kv_room_and_a_fresh_node() -> None:
    full = decode_node("d1", b=4, k=9800, capacity=10_000)
    stale = decode_node("d2", b=4, reported_at=-1.0)
    with pytest.raises(NoHealthyNodeError, match="no fresh decode node has room"):
        alg.decide_without_prefill_pool(500, view((), (full, stale)), 0.0, FLAT, TABLE)
    d = alg.decide_without_prefill_pool(500, view((), (full, stale, decode_node("d3", b=30))), 0.0, FLAT, TABLE)
    assert d.decode_node == "d3"
    with pytest.raises(NoHealthyNodeError, match="no decode node is fresh either"):
        alg.decide_without_prefill_pool(500, view((), (stale,)), 0.0, FLAT, TABLE)


def test_degraded_mode_honours_the_pending_deflection_limit() -> None:
    busy = decode_node("d1", b=4, backlog=(300,))
    one_at_a_time = dataclasses.replace(TABLE, max_pending_deflections=1)
    with pytest.raises(NoHealthyNodeError, match="no fresh decode node has room"):
        alg.decide_without_prefill_pool(500, view((), (busy,)), 0.0, FLAT, one_at_a_time)
    d = alg.decide_without_prefill_pool(500, view((), (busy, decode_node("d2", b=30))), 0.0, FLAT, one_at_a_time)
    assert d.decode_node == "d2"


def test_degraded_mode_takes_the_fastest_node_within_the_bounds() -> None:
    nodes = (decode_node("d0", b=20), decode_node("d1", b=10), decode_node("d2", b=70))
    d = alg.decide_without_prefill_pool(1000, view((), nodes), 0.0, FLAT, TABLE)
    assert (d.route, d.reason, d.decode_node) == (Route.DEFLECT, Reason.DEFLECT_NO_PREFILL_NODE, "d1")
    assert d.predicted_ttft_decode_s == pytest.approx(0.025 + 0.250) and d.chunk_sizes == (410, 410, 180)
    assert d.step_budget_s == TABLE.step_budget_s and all(t <= TABLE.step_budget_s for t in d.predicted_step_s)


# ---------------------------------------------------------------------------------------------
# 6. The step guard counts every token of a step
# ---------------------------------------------------------------------------------------------
def _decode_engine(decodes: int, models: object = PACKAGED) -> Engine:
    """A decode node with ``decodes`` running decodes of 3569-token prompts."""
    engine = Engine(EngineConfig("d1", Role.DECODE, max_step_tokens=4096), model_step_time(models), models)  # type: ignore[arg-type]
    for i in range(decodes):
        seq = Sequence(f"dec{i}", 3569, 1000)
        assert engine.reserve_transfer(seq) == 3569
        engine.accept_transferred(seq, 3569)
    return engine


def test_a_budgeted_chunk_is_sized_with_the_other_prefill_in_its_step() -> None:
    """20 decodes and a local prefill (no schedule, as the sidecar's fallback once sent) of 1000
    tokens ahead of a deflected prefill with a 70 ms budget: the step holds 84 ms already, so the
    deflected chunk waits. Before, it was sized as if alone (about 600 tokens beside the 20
    decodes) and the step ran about 100 ms."""
    engine = _decode_engine(20)
    engine.submit(Sequence("local", 1000, 5))
    engine.submit(Sequence("deflected", 3000, 5, schedule=(2048,), step_budget_s=0.070))
    plan = engine.plan_step(0.0)
    assert plan is not None and [(c.seq.request_id, c.tokens) for c in plan.chunks] == [("local", 1000)]
    assert PACKAGED.mixed_step_s(20 + 1000, 0, 20, plan.kv_tokens) > 0.070


def test_a_prefill_after_a_budgeted_chunk_is_held_to_its_budget() -> None:
    """The deflected chunk first (300 tokens, 62 ms with the 20 decodes), then an unscheduled
    prefill: it takes only what keeps the step within the deflected chunk's 70 ms. Before, it
    took the rest of the step's 4,096 tokens."""
    engine = _decode_engine(20)
    engine.submit(Sequence("deflected", 3000, 5, schedule=(300,), step_budget_s=0.070))
    engine.submit(Sequence("local", 4000, 5))
    plan = engine.plan_step(0.0)
    assert plan is not None
    (deflected, d_tokens), (local, n) = [(c.seq.request_id, c.tokens) for c in plan.chunks]
    assert (deflected, d_tokens, local) == ("deflected", 300, "local") and 0 < n < 4000 - 300
    step = lambda extra: PACKAGED.mixed_step_s(20 + 300 + extra, 0, 20, plan.kv_tokens)  # noqa: E731
    assert step(n) <= 0.070 < step(n + 1)


def test_the_guard_costs_several_chunks_as_the_step_model_does() -> None:
    """Two chunks over different prefixes: as one over their token-weighted cached length, the
    step time the calibration and the simulator's timer cost them at."""
    guard = StepGuard(PACKAGED, 20, 80_000)
    assert guard.take(200, 4000, None) == 200  # no budget in the step yet: nothing holds it
    n = guard.take(2000, 1000, 0.080)
    weighted = lambda m: (200 * 4000 + m * 1000) / (200 + m)  # noqa: E731
    assert 0 < n < 2000
    assert PACKAGED.mixed_step_s(20 + 200 + n, weighted(n), 20, 80_000) <= 0.080
    assert PACKAGED.mixed_step_s(20 + 200 + n + 1, weighted(n + 1), 20, 80_000) > 0.080
    assert guard.take(100, 0, None) == 0  # the step is full at its budget
    assert StepGuard(PACKAGED, 0, 0).take(4000, 0, 0.001) == 4000  # no decode: no TBT to protect


def test_a_keep_carries_its_decode_nodes_step_budget() -> None:
    """For the sidecar's local prefill, should the prefill node fail: the decode node then holds
    the prefill's steps to it, as a deflection's."""
    nodes = (dataclasses.replace(decode_node("d1", b=8), step_calibration=1.25),)
    cfg = DeciderConfig()
    d = alg.decide(3000, view((prefill_node(),), nodes), 0.0, PACKAGED, cfg)
    assert d.route is Route.KEEP and d.step_budget_s == pytest.approx(cfg.step_budget_s / 1.25)
    pd = create_policy("pd", PACKAGED, cfg).decide(3000, view((prefill_node(),), nodes), 0.0)
    assert pd.route is Route.KEEP and pd.step_budget_s == pytest.approx(cfg.step_budget_s / 1.25)
    off = alg.decide(3000, view((prefill_node(),), nodes), 0.0, PACKAGED, DeciderConfig(node_step_guard=False))
    assert off.step_budget_s is None


# ---------------------------------------------------------------------------------------------
# The keep path's estimate on the inputs it has (bench/sim/prediction_error.py measures it)
# ---------------------------------------------------------------------------------------------
UNCACHED_PREFILL = make_models(prefill_knee=600.0, prefill_over_knee=5e-5)  # no cached term: exact packing


def _prefill_end_on_the_engine(models: Any, queue: list[int], prompt: int, chunk: int) -> tuple[float, float]:
    """A prefill node's engine running ``queue``; ``prompt`` arrives during its first step (as a
    request does between two heartbeats): when the prompt's last token is computed, from that
    step's start, and that step's time."""
    engine = Engine(EngineConfig("p1", Role.PREFILL, max_step_tokens=chunk), model_step_time(models))
    for i, tokens in enumerate(queue):
        engine.submit(Sequence(f"q{i}", tokens, 1, hold_kv=True))
    now, first = 0.0, None
    if not queue:
        engine.submit(Sequence("mine", prompt, 1, hold_kv=True))
    while True:
        plan = engine.plan_step(now)
        assert plan is not None
        duration = engine.step_duration(plan)
        if first is None:
            first = duration
            if queue:
                engine.submit(Sequence("mine", prompt, 1, hold_kv=True))
        now += duration
        out = engine.finish_step(plan, now, duration)
        if any(s.request_id == "mine" for s in out.first_tokens):
            return now, first


@pytest.mark.parametrize(
    ("queue", "prompt"),
    [([], 3000), ([700], 3000), ([5000, 300, 2000], 1500), ([4096], 4096), ([100] * 30, 50)],
)
def test_the_packed_queue_is_the_prefill_nodes_own_schedule(queue: list[int], prompt: int) -> None:
    """The node packs its token budget across prompts: after the step it runs at the heartbeat,
    the prompt's first chunk fills what the queue leaves of its last step. With truth = model, the
    estimate is the engine's prefill end, less half the step running at the heartbeat (its phase,
    which a node older than running_step_elapsed_s does not say: tests/unit/test_step_phase.py)."""
    end, first = _prefill_end_on_the_engine(UNCACHED_PREFILL, queue, prompt, 2048)
    node = PrefillNodeState.from_queue("p1", queue, 2048, reported_at=0.0)
    estimate = alg.packed_prefill_s(UNCACHED_PREFILL, node, prompt, now=0.0)
    assert estimate == pytest.approx(end - (0.5 * first if queue else 0.0), rel=1e-12)


def test_a_queued_prompts_computed_prefix_costs_its_attention() -> None:
    """A prefill node's head, 6K of 12K computed: its remaining 6K attend to the 6K before them."""
    models = make_models(prefill_x_cached=4e-9)
    fresh = PrefillNodeState.from_queue("p1", [6000], 2048, 0.0)
    half_done = PrefillNodeState.from_queue("p1", [6000], 2048, 0.0, computed_tokens=[6000])
    sent = dataclasses.replace  # the overlay's: nothing of it has run since the heartbeat
    a = alg.packed_prefill_s(models, sent(fresh, overlay_tokens=6000), 1000)
    b = alg.packed_prefill_s(models, sent(half_done, overlay_tokens=6000), 1000)
    assert b - a == pytest.approx(4e-9 * 6000 * 6000)


def test_a_prefill_node_has_run_its_queue_since_its_heartbeat() -> None:
    """0.05 s after a heartbeat that showed 20K tokens queued, the node has run 0.05 s of them;
    of a queue the dispatcher sent since (the overlay), nothing."""
    reported = PrefillNodeState.from_queue("p1", [20_000], 2048, reported_at=1.0)
    at_once = alg.packed_prefill_s(PACKAGED, reported, 3000, now=1.0)
    assert alg.packed_prefill_s(PACKAGED, reported, 3000, now=1.05) == pytest.approx(at_once - 0.05)
    sent = dataclasses.replace(reported, overlay_tokens=20_000)
    assert alg.packed_prefill_s(PACKAGED, sent, 3000, now=1.05) > at_once


def test_the_keep_estimate_queues_the_incoming_keeps_on_the_link() -> None:
    """A keep sent to d1 ends its prefill 0.2 s from now: its 1000 tokens cross d1's link (1.001
    s on the builders' 1 MB/s link) before a prefill ending at 0.3 s can; one ending after it,
    at 5 s, does not wait ahead. Before, the link held only the pulls the node reported."""
    node = dataclasses.replace(
        decode_node("d1"),
        incoming_keeps=2,
        incoming_keep_tokens=2000,
        incoming_link=IncomingLink.of(((10.2, 1000), (15.0, 1000)), ROUND.kv_transfer_s),
    )
    cfg = DeciderConfig()
    handoff = alg.keep_handoff_s(ROUND, cfg, node, 500, 0.3, now=10.0)
    link_wait = 0.2 + 1.001 - 0.3
    b, k = alg.committed_batch(node)
    join = ROUND.decode_step_s(b + 1, k + 500) + 0.5 * ROUND.decode_step_s(b, k)
    assert handoff == pytest.approx(link_wait + 0.501 + join)
    assert alg.keep_handoff_s(ROUND, cfg, node, 500, 0.3) == pytest.approx(0.501 + join)  # no clock: as before


def test_the_link_has_run_since_the_heartbeat() -> None:
    """A 2000-token pull (2.001 s) running at a heartbeat 0.1 s old: half of it done then, on
    average, and 0.1 s since."""
    node = dataclasses.replace(decode_node("d1", reported_at=9.9), pending_kv_pull_tokens=(2000,))
    cfg = DeciderConfig()
    b, k = alg.committed_batch(node)
    join = ROUND.decode_step_s(b + 1, k + 500) + 0.5 * ROUND.decode_step_s(b, k)
    expected_wait = 2.001 - (0.5 * 2.001 + 0.1) - 0.3
    assert alg.keep_handoff_s(ROUND, cfg, node, 500, 0.3, now=10.0) == pytest.approx(expected_wait + 0.501 + join)


def test_the_view_carries_the_incoming_keeps_link_queue_until_a_heartbeat_shows_them() -> None:
    tracker = ClusterTracker(link=ROUND.transfer)
    tracker.update_prefill(prefill_node("p1", reported_at=0.0))
    tracker.update_decode(decode_node("d1", reported_at=0.0))
    for at, prefill_s, tokens in ((0.1, 2.0, 300), (0.2, 0.5, 400), (0.3, 1.0, 500)):
        keep = Decision(
            Route.KEEP, Reason.KEEP_SLO_ROOM, "d1", "p1", (), 3.0, None, tokens, predicted_prefill_end_s=prefill_s
        )
        tracker.record(keep, at)
    (d1,) = tracker.view().decode
    assert d1.incoming_link == IncomingLink.of(((0.7, 400), (1.3, 500), (2.1, 300)), ROUND.kv_transfer_s)
    tracker.update_decode(decode_node("d1", reported_at=1.5))
    (d1,) = tracker.view().decode
    assert d1.incoming_link is not None and (d1.incoming_keeps, d1.incoming_keep_tokens) == (1, 300)
    assert d1.incoming_link.entries == ((2.1, 300),)
    assert d1.incoming_link.clear_s(2.0, 3.0) == pytest.approx(2.1 + ROUND.kv_transfer_s(300))
    assert d1.incoming_link.clear_s(3.0, 3.0) == pytest.approx(3.0 + ROUND.kv_transfer_s(300))
    (p1,) = tracker.view().prefill
    assert p1.overlay_tokens == 1200 and p1.attention_tokens == pytest.approx(
        sum(prompt_attention_tokens(n, 0, 1000) for n in (300, 400, 500))
    )
    held = d1.incoming_link
    keep = Decision(Route.KEEP, Reason.KEEP_SLO_ROOM, "d1", "p1", (), 3.0, None, 900, predicted_prefill_end_s=0.5)
    tracker.record(keep, 1.6)  # arrives at 2.1 too, after the held one: appended
    tracker.record(dataclasses.replace(keep, prompt_tokens=100), 1.6)  # before it: new lists
    assert held.entries == ((2.1, 300),)  # a state's queue is a value: later keeps do not show in it
    (d1,) = tracker.view().decode
    assert d1.incoming_link is not None and d1.incoming_link.entries == ((2.1, 100), (2.1, 300), (2.1, 900))
    tracker.relink(None)  # a tracker without a link model carries no queue
    assert tracker.view().decode[0].incoming_link is None


@pytest.mark.parametrize("seed", range(20))
def test_the_links_closed_form_is_the_fifo_queue(seed: int) -> None:
    """Keeps joining in any order, the link free from any time: the closed form the view keeps
    is the FIFO queue walked transfer by transfer, for every horizon."""
    rng = random.Random(seed)
    arrivals = [(round(rng.uniform(0, 5), 3), rng.randrange(100, 5000)) for _ in range(rng.randrange(1, 30))]
    tracker = ClusterTracker(link=ROUND.transfer)
    tracker.update_prefill(prefill_node("p1", reported_at=0.0))
    tracker.update_decode(decode_node("d1", reported_at=0.0))
    for at, tokens in arrivals:
        keep = Decision(Route.KEEP, Reason.KEEP_SLO_ROOM, "d1", "p1", (), 3.0, None, tokens, predicted_prefill_end_s=at)
        tracker.record(keep, 0.0)
    (d1,) = tracker.view().decode
    assert d1.incoming_link is not None
    for _ in range(10):
        free_at, until = rng.uniform(0, 10), rng.uniform(0, 6)
        walked = free_at
        for at, tokens in sorted(arrivals):
            if at <= until:
                walked = max(walked, at) + ROUND.kv_transfer_s(tokens)
        assert d1.incoming_link.clear_s(free_at, until) == pytest.approx(walked, rel=1e-12)


def test_a_keep_is_decided_on_the_packed_queue() -> None:
    p1 = PrefillNodeState.from_queue("p1", [5000, 300], 2048, reported_at=0.0)
    d = alg.decide(3000, view((p1,), (decode_node("d1", b=8),)), 0.04, PACKAGED, DeciderConfig())
    assert d.route is Route.KEEP
    assert d.predicted_prefill_end_s == pytest.approx(alg.packed_prefill_s(PACKAGED, p1, 3000, now=0.04))
    eq1 = alg.decide(3000, view((p1,), (decode_node("d1", b=8),)), 0.04, PACKAGED, DeciderConfig(keep_estimate="eq1"))
    assert eq1.predicted_ttft_prefill_s == pytest.approx(alg.prefill_ttft_s(PACKAGED, p1, 3000))


def test_the_heartbeat_carries_each_queued_prefills_computed_prefix_to_the_prefill_state() -> None:
    raw = json.loads(beat("p0", queued_prefill_tokens=[6000, 300], max_step_tokens=2048))
    raw[HeartbeatField.QUEUED_PREFILL_COMPUTED_TOKENS] = [6000, 0]
    m = Membership(MembershipConfig())
    m.poll_succeeded([("p0", json.dumps(raw))], 5.0)
    (p0,) = m.tracker.view().prefill
    assert p0.attention_tokens == pytest.approx(
        prompt_attention_tokens(6000, 6000, 2048) + prompt_attention_tokens(300, 0, 2048)
    )
    raw[HeartbeatField.QUEUED_PREFILL_COMPUTED_TOKENS] = [6000]
    with pytest.raises(MalformedHeartbeat, match="queued_prefill_computed_tokens has 1 entries for 2"):
        parse_heartbeat(json.dumps(raw), "p0")
