"""The step a node is running when its state is read (issue 32, item 4): the engine says how long
that step has run (``running_step_elapsed_s``, in the engine state and the heartbeat), and the
estimators take what is left of it instead of half a step on average.

With truth = model, a state taken part way into a step, and the field, the keep path's prefill end
and the deflect path's TTFT are the engine's, to the float; without the field (a node older than
it), half a step, as before. The contract carries it and refuses what no step can have run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kairos.common.contracts import (
    EngineState,
    EngineStateError,
    HeartbeatField,
    MalformedHeartbeat,
    Role,
    encode_engine_state,
    encode_heartbeat,
    parse_engine_state,
    parse_heartbeat,
)
from kairos.core import algorithm as alg
from kairos.core.algorithm import DeciderConfig, plan_on_decode_node
from kairos.core.algorithm.bounds import node_facts, plan_on_path
from kairos.core.algorithm.schedule import Plan, backlog_end, expand_runs
from kairos.core.algorithm.search import search_bounded, search_in_id_order
from kairos.core.decision import Decision, Reason, Route
from kairos.core.policies import create_policy
from kairos.core.state import DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.extproc.membership import Membership, MembershipConfig
from kairos.nodeagent.heartbeat import build_heartbeat, elapsed_at
from kairos.nodeagent.vllm_plugin.engine_state import build_state
from kairos.sim.engine import Engine, EngineConfig, Sequence, model_step_time
from kairos.sim.simulator import ClusterConfig, Simulator, _decode_state, _Link, _prefill_state
from kairos.traffic.requests import RequestSpec
from tests.builders import BIG_KV, decode_node, flat_models, make_models, view
from tests.builders import heartbeat_json as beat

UNLIMITED = DeciderConfig(max_pending_deflections=None)
ELAPSED = HeartbeatField.RUNNING_STEP_ELAPSED_S
PULL_ELAPSED = HeartbeatField.RUNNING_KV_PULL_ELAPSED_S


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------
def test_the_heartbeat_carries_how_long_the_running_step_has_run() -> None:
    older = beat("d0", decode_tokens=20)
    assert ELAPSED not in json.loads(older)
    assert parse_heartbeat(older, "d0").running_step_elapsed_s is None  # a node older than the field
    assert PULL_ELAPSED not in json.loads(older)
    for value in (0, 0.0125, 7.5):
        hb = parse_heartbeat(beat("d0", decode_tokens=20, running_step_elapsed_s=value), "d0")
        assert hb.running_step_elapsed_s == value
        assert parse_heartbeat(encode_heartbeat(hb), "d0") == hb
        assert json.loads(encode_heartbeat(hb))[ELAPSED] == value
    hb = parse_heartbeat(beat("d0", pending_kv_pull_tokens=[3000], running_kv_pull_elapsed_s=0.04), "d0")
    assert hb.running_kv_pull_elapsed_s == 0.04 and parse_heartbeat(encode_heartbeat(hb), "d0") == hb


@pytest.mark.parametrize("field", [ELAPSED, PULL_ELAPSED])
@pytest.mark.parametrize("value", [-0.001, "0.01", True, [0.01], {}])
def test_a_heartbeat_with_a_bad_elapsed_time_is_refused(field: str, value: object) -> None:
    with pytest.raises(MalformedHeartbeat, match=rf"^{field} must be a number of seconds >= 0, got "):
        parse_heartbeat(beat("d0", **{field: value}), "d0")


@pytest.mark.parametrize("field", [ELAPSED, PULL_ELAPSED])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_heartbeat_with_a_non_finite_elapsed_time_is_refused(field: str, value: str) -> None:
    """JSON has no NaN nor infinity; Python's reader makes them, and the checked decoder refuses them."""
    raw = beat("d0", **{field: 0.5}).replace(f'"{field}": 0.5', f'"{field}": {value}')
    assert value in raw
    with pytest.raises(MalformedHeartbeat, match=f"{field} must be a number of seconds >= 0"):
        parse_heartbeat(raw, "d0")


def _state(**changes: Any) -> EngineState:
    fields: dict[str, Any] = {
        "decode_tokens": 20,
        "kv_tokens": 70_000,
        "kv_capacity_tokens": BIG_KV,
        "queued_prefill_tokens": (),
        "scheduled_prefill_tokens": (),
        "max_step_tokens": 2048,
        "model": "m",
        **changes,
    }
    return EngineState(**fields)


def test_the_engine_state_carries_it_and_refuses_what_no_step_can_have_run() -> None:
    state = _state(running_step_elapsed_s=0.02)
    assert parse_engine_state(encode_engine_state(state)) == state
    assert ELAPSED not in json.loads(encode_engine_state(_state()))  # idle: left out
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(EngineStateError, match="engine state: running_step_elapsed_s must be a number of seconds"):
            _state(running_step_elapsed_s=bad)
        with pytest.raises(
            EngineStateError, match="engine state: running_kv_pull_elapsed_s must be a number of seconds"
        ):
            _state(pending_kv_pull_tokens=(10,), running_kv_pull_elapsed_s=bad)
    raw = json.loads(encode_engine_state(state)) | {ELAPSED: -0.5}
    with pytest.raises(EngineStateError, match="engine state: running_step_elapsed_s must be a number of seconds"):
        parse_engine_state(json.dumps(raw))


def test_the_vllm_plugins_state_carries_it() -> None:
    state = build_state(
        decode_tokens=4,
        kv_tokens=900,
        kv_capacity_tokens=BIG_KV,
        prefills=[],
        max_step_tokens=2048,
        model="m",
        running_requests=4,
        waiting_requests=0,
        kv_usage=0.01,
        running_step_elapsed_s=0.0,
    )
    assert state.running_step_elapsed_s == 0.0 and state.as_of is not None
    assert parse_engine_state(encode_engine_state(state)) == state


def test_the_publisher_counts_the_time_since_the_state_was_taken() -> None:
    """A state taken at as_of (the plugin's, between two steps) is sent later: the step has run
    that much longer by then, the instant the dispatcher's heartbeat age counts from."""
    snapshot = _state(running_step_elapsed_s=0.0, as_of=1000.0)
    assert elapsed_at(0.0, snapshot, 1000.035) == pytest.approx(0.035)
    assert elapsed_at(0.01, _state(), 1000.035) == 0.01  # no as_of: taken as it was read
    assert elapsed_at(0.0, msgspec.structs.replace(snapshot, as_of=1000.5), 1000.035) == 0.0  # another clock
    assert elapsed_at(None, snapshot, 1000.035) is None  # nothing in flight
    node = SimpleNamespace(node_id="d0", role="decode", url="127.0.0.1:8101", sidecar="127.0.0.1:8201")
    pulling = msgspec.structs.replace(snapshot, pending_kv_pull_tokens=(500,), running_kv_pull_elapsed_s=0.1)
    hb = parse_heartbeat(encode_heartbeat(build_heartbeat(node, pulling, 7, 1000.035)), "d0")  # type: ignore[arg-type]
    assert hb.running_step_elapsed_s == pytest.approx(0.035)
    assert hb.running_kv_pull_elapsed_s == pytest.approx(0.135)
    assert ELAPSED not in json.loads(encode_heartbeat(build_heartbeat(node, _state(), 8, 1000.0)))  # type: ignore[arg-type]


def test_membership_hands_it_to_the_decision_state() -> None:
    m = Membership(MembershipConfig())
    m.poll_succeeded(
        [
            ("d0", beat("d0", decode_tokens=20, running_step_elapsed_s=0.011, running_kv_pull_elapsed_s=0.2)),
            ("d1", beat("d1", decode_tokens=20)),
            ("p0", beat("p0", queued_prefill_tokens=[3000], max_step_tokens=2048, running_step_elapsed_s=0.07)),
        ],
        5.0,
    )
    v = m.tracker.view()
    assert {n.node_id: n.running_step_elapsed_s for n in v.decode} == {"d0": 0.011, "d1": None}
    assert {n.node_id: n.running_kv_pull_elapsed_s for n in v.decode} == {"d0": 0.2, "d1": None}
    assert v.prefill[0].running_step_elapsed_s == 0.07


def test_a_state_refuses_a_bad_elapsed_time_and_the_overlay_keeps_it() -> None:
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="running_step_elapsed_s must be a number >= 0"):
            dataclasses.replace(decode_node("d1"), running_step_elapsed_s=bad)
        with pytest.raises(ValueError, match="running_kv_pull_elapsed_s must be a number >= 0"):
            dataclasses.replace(decode_node("d1"), running_kv_pull_elapsed_s=bad)
        with pytest.raises(ValueError, match="running_step_elapsed_s must be a number >= 0"):
            PrefillNodeState.from_queue("p1", [10], 2048, 0.0, running_step_elapsed_s=bad)
    with pytest.raises(ValueError, match=r"overlay_backlog=2 must be within 0\.\.1"):
        dataclasses.replace(decode_node("d1", backlog=(10,)), overlay_backlog=2)
    tracker = ClusterTracker()
    tracker.update_decode(dataclasses.replace(decode_node("d1", b=3), running_step_elapsed_s=0.004))
    tracker.update_prefill(PrefillNodeState.from_queue("p1", [500], 2048, 0.0, running_step_elapsed_s=0.03))
    d = alg.decide(300, tracker.view(), 0.01, flat_models(), DeciderConfig())
    tracker.record(d, 0.01)
    v = tracker.view()
    assert (v.decode[0].running_step_elapsed_s, v.prefill[0].running_step_elapsed_s) == (0.004, 0.03)


# ---------------------------------------------------------------------------------------------
# The engine and the simulator fill it
# ---------------------------------------------------------------------------------------------
def test_the_engine_says_how_long_its_step_in_flight_has_run() -> None:
    models = flat_models()
    engine = Engine(EngineConfig("d1", Role.DECODE), model_step_time(models), models)
    assert engine.snapshot(1.0).running_step_elapsed_s is None  # idle
    engine.submit(Sequence("r1", 500, 3))
    plan = engine.plan_step(1.0)
    assert plan is not None
    assert engine.snapshot(1.015).running_step_elapsed_s == pytest.approx(0.015)
    assert engine.snapshot().running_step_elapsed_s is None  # no time given
    assert _decode_state(engine.snapshot(1.015), 1.015, _Link()).running_step_elapsed_s == pytest.approx(0.015)
    engine.finish_step(plan, 1.1, 0.1)
    assert engine.snapshot(1.1).running_step_elapsed_s is None  # between a step's end and the next one's plan
    prefill = Engine(EngineConfig("p1", Role.PREFILL), model_step_time(models))
    prefill.submit(Sequence("q", 5000, 1, hold_kv=True))
    assert _prefill_state(prefill, 0.0).running_step_elapsed_s is None
    assert prefill.plan_step(0.0) is not None
    state = _prefill_state(prefill, 0.02)
    assert state.running_step_elapsed_s == pytest.approx(0.02) and state.reported_at == 0.02


def test_the_simulators_heartbeats_carry_it_to_the_decisions() -> None:
    models = flat_models()
    seen: list[float | None] = []

    class Watching:
        label, fresh_state = "watching", False

        def __init__(self) -> None:
            self.policy = create_policy("kairos", models, DeciderConfig())

        def decide(self, prompt_tokens: int, v: Any, now: float, **kwargs: Any) -> Any:
            seen.extend(n.running_step_elapsed_s for n in (*v.prefill, *v.decode))
            return self.policy.decide(prompt_tokens, v, now, **kwargs)

    requests = [RequestSpec(f"r{i}", 0.05 + 0.037 * i, 1500 + 97 * i, 40) for i in range(60)]
    Simulator(requests, Watching(), models, ClusterConfig(1, 1)).run()  # type: ignore[arg-type]
    reported = [e for e in seen if e is not None]
    assert len(reported) > len(seen) / 2  # the nodes are busy most of the run
    assert all(0 <= e < 1.0 for e in reported)  # less than the longest step here


# ---------------------------------------------------------------------------------------------
# The keep path's prefill end: the prefill node's step in flight
# ---------------------------------------------------------------------------------------------
UNCACHED_PREFILL = make_models(prefill_knee=600.0, prefill_over_knee=5e-5)  # no cached term: exact packing


def _run_until(engine: Engine, plan: Any, until: float) -> tuple[Any, float]:
    """Run the engine's steps (the one in flight first) until one ends after ``until``: the
    plan in flight then and when it ends."""
    end = plan.start + engine.step_duration(plan)
    while end <= until:
        engine.finish_step(plan, end, end - plan.start)
        plan = engine.plan_step(end)
        assert plan is not None
        end = plan.start + engine.step_duration(plan)
    return plan, end


def _prompt_done(engine: Engine, plan: Any, request_id: str) -> float:
    while True:
        end = plan.start + engine.step_duration(plan)
        out = engine.finish_step(plan, end, end - plan.start)
        if any(s.request_id == request_id for s in out.first_tokens):
            return end
        plan = engine.plan_step(end)
        assert plan is not None


@pytest.mark.parametrize(("share", "age_steps"), [(0.1, 0.0), (0.8, 0.0), (0.3, 0.5), (0.6, 1.7)])
def test_the_keep_estimate_takes_the_rest_of_the_prefill_nodes_running_step(share: float, age_steps: float) -> None:
    """A heartbeat taken ``share`` into a prefill node's step, read ``age_steps`` steps later: the
    estimate is when the engine computes the prompt's last token, from the decision (the step's
    rest, then the queue packed; the age counted once). Without the field, half the step."""
    models, queue, prompt = UNCACHED_PREFILL, [5000, 300, 2000], 1500
    engine = Engine(EngineConfig("p1", Role.PREFILL, max_step_tokens=2048), model_step_time(models))
    for i, tokens in enumerate(queue):
        engine.submit(Sequence(f"q{i}", tokens, 1, hold_kv=True))
    plan = engine.plan_step(0.0)
    assert plan is not None
    first = engine.step_duration(plan)
    at = share * first
    node = _prefill_state(engine, at)  # the heartbeat
    assert node.running_step_elapsed_s == pytest.approx(at)
    now = at + age_steps * first
    plan, _ = _run_until(engine, plan, now)
    engine.submit(Sequence("mine", prompt, 1, hold_kv=True))  # decided and sent at ``now``
    truth = _prompt_done(engine, plan, "mine") - now
    estimate = alg.packed_prefill_s(models, node, prompt, now=now)
    assert estimate == pytest.approx(truth, rel=1e-12)
    older = dataclasses.replace(node, running_step_elapsed_s=None)
    assert alg.packed_prefill_s(models, older, prompt, now=now) == pytest.approx(truth + at - 0.5 * first, rel=1e-12)
    eq1 = DeciderConfig(keep_estimate="eq1")  # Eq. 1: no phase, with or without the field
    assert alg.keep_prefill_s(models, eq1, node, prompt, now=now) == alg.keep_prefill_s(models, eq1, older, prompt)


def test_a_keep_decision_predicts_from_the_rest_of_the_running_step() -> None:
    models = UNCACHED_PREFILL
    p1 = PrefillNodeState.from_queue("p1", [5000, 300], 2048, reported_at=0.0, running_step_elapsed_s=0.15)
    d = alg.decide(3000, view((p1,), (decode_node("d1", b=8),)), 0.04, models, DeciderConfig())
    assert d.route is Route.KEEP
    assert d.predicted_prefill_end_s == pytest.approx(alg.packed_prefill_s(models, p1, 3000, now=0.04))
    half = alg.packed_prefill_s(models, dataclasses.replace(p1, running_step_elapsed_s=None), 3000, now=0.04)
    assert d.predicted_prefill_end_s != pytest.approx(half)


# ---------------------------------------------------------------------------------------------
# The deflect path: the decode node's step in flight
# ---------------------------------------------------------------------------------------------
FLAT = flat_models(decode_b0=0.010)  # no term in K: a node's decode steps are all alike (30 ms at B = 20)


def _decoding_engine(b: int, guard: bool = False) -> Engine:
    """A decode node running ``b`` long decodes (joined by KV transfer)."""
    engine = Engine(
        EngineConfig("d1", Role.DECODE, max_step_tokens=8192), model_step_time(FLAT), FLAT if guard else None
    )
    for i in range(b):
        seq = Sequence(f"d{i}", 1000, 10_000)
        missing = engine.reserve_transfer(seq)
        assert missing is not None
        engine.accept_transferred(seq, missing)
    return engine


@pytest.mark.parametrize(
    ("share", "steps_before", "age_steps"),
    [(0.05, 0, 0.0), (0.5, 0, 0.0), (0.95, 3, 0.0), (0.3, 1, 0.5), (0.8, 0, 2.6)],
)
def test_a_deflection_is_planned_from_the_rest_of_the_decode_nodes_running_step(
    share: float, steps_before: int, age_steps: float
) -> None:
    """Truth = model: a deflection decided ``age_steps`` steps after a heartbeat taken ``share``
    into the node's decode step gets its first token when the plan says, to the float (the age
    counted once: the step train's phase then); without the field, half a step from the heartbeat."""
    engine = _decoding_engine(20)
    plan = engine.plan_step(0.0)
    assert plan is not None
    step = engine.step_duration(plan)
    plan, _ = _run_until(engine, plan, steps_before * step)
    at = plan.start + share * step
    node = _decode_state(engine.snapshot(at), at, _Link())
    now = at + age_steps * step
    decided = plan_on_decode_node(FLAT, UNLIMITED, node, 3000, math.inf, 0, now)
    assert isinstance(decided, Plan)
    plan, _ = _run_until(engine, plan, now)
    sizes, _ = expand_runs(decided.runs)
    engine.submit(Sequence("mine", 3000, 5, schedule=tuple(sizes)))
    truth = _prompt_done(engine, plan, "mine") - now
    assert decided.ttft_s == pytest.approx(truth, rel=1e-12)
    assert plan_on_path(FLAT, UNLIMITED, node, 3000, math.inf, 0, now) == decided
    assert alg.ttft_lower_bound_s(FLAT, UNLIMITED, node, 3000, now) <= decided.ttft_s * (1 + 1e-9)
    older = dataclasses.replace(node, running_step_elapsed_s=None)
    as_before = plan_on_decode_node(FLAT, UNLIMITED, older, 3000, math.inf, 0, now)
    assert isinstance(as_before, Plan)  # from the heartbeat, half a step: the age not counted
    wait = step - (share * step + now - at) % step  # to the end of the step running at ``now``
    assert as_before.ttft_s == pytest.approx(truth - wait + 0.5 * step, rel=1e-12)


def _deflected(engine: Engine, request_id: str, prompt: int, at: float, give_up: float = math.inf) -> Plan:
    """Plan a deflection on ``engine``'s node from a heartbeat taken now, and send it there."""
    plan = plan_on_decode_node(FLAT, UNLIMITED, _decode_state(engine.snapshot(at), at, _Link()), prompt, give_up)
    assert isinstance(plan, Plan)
    engine.submit(Sequence(request_id, prompt, 10_000, schedule=tuple(expand_runs(plan.runs)[0])))  # decodes on
    return plan


@pytest.mark.parametrize("age_steps", [0.0, 0.4, 3.2])
def test_a_deflection_queued_behind_a_running_one_starts_when_it_ends(age_steps: float) -> None:
    """A heartbeat shows a deflected prefill mid-chunk: a deflection decided ``age_steps`` steps
    later runs after it, and gets its first token when the plan says."""
    engine = _decoding_engine(20)
    plan = engine.plan_step(0.0)
    assert plan is not None
    _deflected(engine, "first", 6000, 0.5 * engine.step_duration(plan))
    plan, _ = _run_until(engine, plan, 3.5 * engine.step_duration(plan))  # its chunks are running
    assert plan.chunks
    at = plan.start + 0.4 * engine.step_duration(plan)
    node = _decode_state(engine.snapshot(at), at, _Link())
    assert node.prefill_backlog_tokens and node.prefill_backlog_computed_tokens[0] > 0
    now = at + age_steps * engine.step_duration(plan)
    decided = plan_on_decode_node(FLAT, UNLIMITED, node, 2000, math.inf, 0, now)
    assert isinstance(decided, Plan)
    plan, _ = _run_until(engine, plan, now)
    engine.submit(Sequence("mine", 2000, 5, schedule=tuple(expand_runs(decided.runs)[0])))
    truth = _prompt_done(engine, plan, "mine") - now
    assert decided.ttft_s == pytest.approx(truth, rel=1e-12)


def test_a_deflection_sent_since_the_heartbeat_starts_after_the_decodes_step() -> None:
    """The heartbeat showed only decodes; a deflection sent since (the view's overlay) was not
    running then: it starts at the end of the decodes' step, whole, and one decided after it
    queues behind it (both sent within one step)."""
    engine = _decoding_engine(20)
    plan = engine.plan_step(0.0)
    assert plan is not None
    step = engine.step_duration(plan)
    at, sent, now = 0.2 * step, 0.3 * step, 0.45 * step
    tracker = ClusterTracker()
    tracker.update_decode(_decode_state(engine.snapshot(at), at, _Link()))
    first = _deflected(engine, "first", 6000, at)
    sizes, times = expand_runs(first.runs)
    tracker.record(
        Decision(
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            "d1",
            None,
            tuple(sizes),
            None,
            first.ttft_s,
            6000,
            None,
            tuple(times),
            20,
        ),
        sent,
    )
    (node,) = tracker.view().decode
    assert (node.prefill_backlog_tokens, node.overlay_backlog) == ((6000,), 1)
    decided = plan_on_decode_node(FLAT, UNLIMITED, node, 2000, math.inf, 0, now)
    assert isinstance(decided, Plan)
    engine.submit(Sequence("mine", 2000, 5, schedule=tuple(expand_runs(decided.runs)[0])))
    truth = _prompt_done(engine, plan, "mine") - now
    assert decided.ttft_s == pytest.approx(truth, rel=1e-12)


def test_a_state_older_than_its_step_takes_the_step_running_by_then() -> None:
    """Back-to-back decode steps: 2.3 steps after one began, the node is 0.3 into another."""
    node = dataclasses.replace(decode_node("d1", b=20, k=20_000), running_step_elapsed_s=0.0)
    step = FLAT.decode_step_s(20, 20_000)
    later = dataclasses.replace(node, running_step_elapsed_s=2.3 * step)
    assert backlog_end(FLAT, UNLIMITED, node)[2] == pytest.approx(step)
    assert backlog_end(FLAT, UNLIMITED, later)[2] == pytest.approx(0.7 * step)
    assert backlog_end(FLAT, DeciderConfig(keep_estimate="eq1"), later)[2] == 0.0  # the paper's: at once
    idle = dataclasses.replace(decode_node("d1"), running_step_elapsed_s=None)
    assert backlog_end(FLAT, UNLIMITED, idle)[2] == 0.0


def test_a_backlog_ends_what_its_running_chunk_has_run_earlier() -> None:
    """The backlog's head is the prefill whose chunk the node runs: its schedule counts that chunk
    whole, less what the node says it has run of it (half the chunk where it does not say; at
    most the head's whole schedule)."""
    base = dataclasses.replace(
        decode_node("d1", b=15, k=60_000, backlog=(6000,)), prefill_backlog_computed_tokens=(6000,)
    )
    whole = backlog_end(FLAT, DeciderConfig(keep_estimate="eq1", max_pending_deflections=None), base)[2]
    half = backlog_end(FLAT, UNLIMITED, base)[2]
    assert isinstance(whole, float) and isinstance(half, float)
    first_chunk = 2 * (whole - half)
    assert first_chunk > 0
    for elapsed in (0.0, 0.01, 0.3 * first_chunk):
        node = dataclasses.replace(base, running_step_elapsed_s=elapsed)
        assert backlog_end(FLAT, UNLIMITED, node)[2] == pytest.approx(whole - elapsed, rel=1e-12)
        own = plan_on_decode_node(FLAT, UNLIMITED, node, 2000, math.inf)
        before = plan_on_decode_node(
            FLAT, UNLIMITED, dataclasses.replace(base, running_step_elapsed_s=0.0), 2000, math.inf
        )
        assert isinstance(own, Plan) and isinstance(before, Plan)
        assert own.ttft_s == pytest.approx(before.ttft_s - elapsed, rel=1e-12)
    stale = dataclasses.replace(base, running_step_elapsed_s=1e6)
    assert backlog_end(FLAT, UNLIMITED, stale)[2] == 0.0


def _twins(n: int) -> list[DecodeNodeState]:
    """``n`` decode nodes alike but for their step's phase: the last one's step is nearly done."""
    step = FLAT.decode_step_s(20, 20_000)
    return [
        dataclasses.replace(
            decode_node(f"d{i}", b=20, k=20_000), running_step_elapsed_s=(0.999 if i == n - 1 else 0.0) * step
        )
        for i in range(n)
    ]


def test_the_search_tells_nodes_apart_by_their_steps_phase() -> None:
    """Alike in every other field, the node about to end its step starts the prompt first: each
    node is planned on its own phase, in the id-order search and the bounded one."""
    for nodes in (_twins(2), _twins(5)):
        best, _ = search_in_id_order(FLAT, UNLIMITED, nodes, 3000, math.inf)
        assert best is not None and best[1] == nodes[-1].node_id
        assert best[0] == pytest.approx(plan_on_decode_node(FLAT, UNLIMITED, nodes[-1], 3000, math.inf).ttft_s)  # type: ignore[union-attr]
    nodes = _twins(5)
    facts = [node_facts(FLAT, UNLIMITED, n) for n in nodes]
    best, _ = search_bounded(FLAT, UNLIMITED, nodes, 3000, math.inf, facts)
    assert best is not None and best[1] == nodes[-1].node_id


# ---------------------------------------------------------------------------------------------
# The keep path's join: the decode node's step when the KV lands
# ---------------------------------------------------------------------------------------------
def test_the_keep_path_joins_at_the_decode_steps_projected_to_the_kvs_landing() -> None:
    """The KV lands ``prefill_s + transfer`` from now; the node's decode steps, projected from the
    step in flight at its heartbeat (and the heartbeat's age), end that much after it. A node that
    does not say, or one running a deflected prefill: half a step, as before."""
    models, cfg = make_models(), DeciderConfig()
    node = dataclasses.replace(decode_node("d1", b=20, k=20_000, reported_at=10.0), running_step_elapsed_s=0.013)
    step = models.decode_step_s(20, 20_000)
    prefill_s, now = 0.3, 10.02
    transfer = models.kv_transfer_s(500)
    own = models.decode_step_s(21, 20_500)
    lands = prefill_s + transfer
    wait = step - (0.013 + 0.02 + lands) % step
    assert alg.keep_handoff_s(models, cfg, node, 500, prefill_s, now=now) == pytest.approx(transfer + own + wait)
    half = transfer + own + 0.5 * step
    assert alg.keep_handoff_s(models, cfg, node, 500, prefill_s) == pytest.approx(half)  # no clock: as before
    older = dataclasses.replace(node, running_step_elapsed_s=None)
    assert alg.keep_handoff_s(models, cfg, older, 500, prefill_s, now=now) == pytest.approx(half)
    busy = dataclasses.replace(node, prefill_backlog_tokens=(3000,))
    b, k = alg.committed_batch(busy)
    expected = transfer + models.decode_step_s(b + 1, k + 500) + 0.5 * models.decode_step_s(b, k)
    assert alg.keep_handoff_s(models, cfg, busy, 500, prefill_s, now=now) == pytest.approx(expected)
    idle = dataclasses.replace(decode_node("d1", reported_at=10.0), running_step_elapsed_s=None)
    assert alg.keep_handoff_s(models, cfg, idle, 500, prefill_s, now=now) == pytest.approx(
        transfer + models.decode_step_s(1, 500)
    )


# ---------------------------------------------------------------------------------------------
# The keep path's link: the KV pull in flight
# ---------------------------------------------------------------------------------------------
def test_the_simulators_decode_node_says_how_long_its_kv_pull_has_run() -> None:
    link = _Link()
    engine = Engine(EngineConfig("d1", Role.DECODE), model_step_time(FLAT), FLAT)
    assert _decode_state(engine.snapshot(5.0), 5.0, link).running_kv_pull_elapsed_s is None
    link.busy, link.current_tokens, link.current_started = True, 3000, 4.8
    state = _decode_state(engine.snapshot(5.0), 5.0, link)
    assert state.pending_kv_pull_tokens == (3000,) and state.running_kv_pull_elapsed_s == pytest.approx(0.2)


def test_the_keep_estimate_takes_the_rest_of_the_kv_pull_in_flight() -> None:
    """A 2000-token pull (2.001 s on the builders' link) 0.3 s into its transfer at a heartbeat
    0.1 s old: 1.601 s of it is left, of which a prefill ending 0.3 s from now leaves 1.301 s to
    wait; a node that does not say is taken to be half through it."""
    models, cfg = make_models(), DeciderConfig()
    node = dataclasses.replace(
        decode_node("d1", reported_at=9.9), pending_kv_pull_tokens=(2000,), running_kv_pull_elapsed_s=0.3
    )
    b, k = alg.committed_batch(node)
    join = models.decode_step_s(b + 1, k + 500) + 0.5 * models.decode_step_s(b, k)
    transfer = models.kv_transfer_s(500)
    exact = alg.keep_handoff_s(models, cfg, node, 500, 0.3, now=10.0)
    assert exact == pytest.approx((2.001 - 0.3 - 0.1 - 0.3) + transfer + join)
    older = dataclasses.replace(node, running_kv_pull_elapsed_s=None)
    assert alg.keep_handoff_s(models, cfg, older, 500, 0.3, now=10.0) == pytest.approx(
        (2.001 - 0.5 * 2.001 - 0.1 - 0.3) + transfer + join
    )
