"""Per-request SLOs (kairos.core.slo): the headers, the classes, Eq. 7's bound and Eq. 5's tau from
the request's own SLOs and the decode node's tightest TPOT in flight, the node's guard, the
cluster view's overlay, the heartbeat field, the mixed-class workload and per-class figures.

Models are the builders' flat ones: T0(B) = 0.040 + 0.001 B, a chunk of p prefill tokens adds
1e-4 p; a prefill step of n tokens is 0.010 + 1e-4 n.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.errors import ConfigError, InvalidRequestError, OverloadedError
from kairos.common.http_errors import error_status
from kairos.core import algorithm as alg
from kairos.core.admission import AdmissionLimits
from kairos.core.algorithm import DeciderConfig, decide
from kairos.core.decision import Decision, Reason, Route
from kairos.core.policies import create_policy
from kairos.core.slo import (
    DEFAULT_CLASSES,
    RequestSLO,
    SloClass,
    classify,
    parse_classes,
    request_slo,
    tau_scaled_budget_s,
    tightest_tpot_s,
)
from kairos.core.state import ClusterView, DecodeNodeState
from kairos.core.view import ClusterTracker
from kairos.extproc.admission import AdmissionGate
from kairos.extproc.metrics import DispatcherMetrics
from kairos.sim.engine import Engine, EngineConfig, model_step_time
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.workloads import make_class_mix
from tests.builders import decode_node, flat_models, heartbeat_json, prefill_node, view

MODELS = flat_models()
CONFIG = DeciderConfig()  # tau 70 ms, TTFT SLO 4 s, beta 1, gate at 1 s of keep estimate
BUSY_PREFILL = prefill_node(queue=(20_000,))  # 20 chunks of 0.11 s queued: a keep path of ~2.3 s
PROMPT = 1000


def node(b: int = 4, tpot: float | None = None, node_id: str = "d1") -> DecodeNodeState:
    s = decode_node(node_id, b=b, k=1000 * b)
    return DecodeNodeState(
        **{f: getattr(s, f) for f in s.__dataclass_fields__ if f not in ("derived", "_free_kv")} | {"tpot_slo_s": tpot}
    )


def deflect(d: DecodeNodeState, slo: RequestSLO | None) -> Decision:
    return decide(PROMPT, view((BUSY_PREFILL,), (d,)), 0.0, MODELS, CONFIG, slo=slo)


# ---------------------------------------------------------------------------------------------
# Headers and classes
# ---------------------------------------------------------------------------------------------
def test_absent_headers_are_the_cluster_defaults() -> None:
    assert request_slo(None, None) == RequestSLO(defaults.TTFT_SLO_S, defaults.TBT_SLO_S, 0)
    assert request_slo(None, None, 3, default_ttft_s=2.0, default_tpot_s=0.1) == RequestSLO(2.0, 0.1, 3)


@pytest.mark.parametrize(
    ("ttft", "tpot", "expected"), [("1000", "60", (1.0, 0.06)), (" 250.5 ", "150", (0.2505, 0.15))]
)
def test_headers_are_milliseconds(ttft: str, tpot: str, expected: tuple[float, float]) -> None:
    slo = request_slo(ttft, tpot)
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "abc", "-5", "0", "0.5", "nan", "inf", "1e12", "１０００", "10ms"])
@pytest.mark.parametrize("header", [c.H_SLO_TTFT_MS, c.H_SLO_TPOT_MS])
def test_a_bad_header_is_a_400_naming_it(bad: str, header: str) -> None:
    args = (bad, None) if header == c.H_SLO_TTFT_MS else (None, bad)
    with pytest.raises(InvalidRequestError, match=header) as info:
        request_slo(*args)
    assert error_status(info.value) == 400


def test_headers_have_their_one_home_and_take_the_headers_route() -> None:
    assert c.SLO_HEADERS == ("x-slo-ttft-ms", "x-slo-tpot-ms")  # llm-d's names
    # What a decision answers with starts with the routing prefix: a client cannot spoof it.
    for name in (c.H_DECIDED_TTFT_SLO_MS, c.H_DECIDED_TPOT_SLO_MS, c.H_SLO_CLASS):
        assert name.startswith(c.HEADER_PREFIX) and name in c.ROUTING_HEADERS and name in c.ECHOED_RESPONSE_HEADERS


@pytest.mark.parametrize(
    ("ttft", "tpot", "name"),
    [
        (1.0, 0.060, "interactive"),
        (0.5, 0.020, "interactive"),  # tighter than every class: the tightest
        (2.0, 0.060, "standard"),
        (1.0, 0.065, "standard"),
        (4.0, 0.070, "standard"),
        (20.0, 0.150, "batch"),
        (5.0, 0.070, "batch"),
        (60.0, 0.010, "batch"),  # looser than every class in one SLO: the loosest
    ],
)
def test_classify_is_the_tightest_class_whose_bounds_hold_the_request(ttft: float, tpot: float, name: str) -> None:
    assert classify(ttft, tpot, DEFAULT_CLASSES) == name


def test_classes_parse_sorted_tightest_first_and_refuse_bad_ones() -> None:
    classes = parse_classes("batch=20000/150, interactive=1000/60")
    assert classes == (SloClass("interactive", 1.0, 0.06), SloClass("batch", 20.0, 0.15))
    for bad in ("", "x=1/", "x", "a b=1/2", "a=1/2,a=3/4", "a=-1/5"):
        with pytest.raises(ConfigError):
            parse_classes(bad)


# ---------------------------------------------------------------------------------------------
# Algorithm 1 with the request's own SLOs
# ---------------------------------------------------------------------------------------------
def test_no_slo_is_the_cluster_decision_to_the_bit() -> None:
    d = node()
    cluster = RequestSLO(CONFIG.ttft_slo_s, CONFIG.tbt_slo_s)
    plain, same = deflect(d, None), deflect(d, cluster)
    assert plain.route is Route.DEFLECT
    assert (same.chunk_sizes, same.predicted_ttft_decode_s, same.step_budget_s) == (
        plain.chunk_sizes,
        plain.predicted_ttft_decode_s,
        plain.step_budget_s,
    )
    assert same.slo == cluster and plain.slo is None


def test_the_request_ttft_slo_is_eq7_bound() -> None:
    d = node()
    loose = deflect(d, RequestSLO(1.0, CONFIG.tbt_slo_s))
    assert loose.route is Route.DEFLECT and loose.predicted_ttft_decode_s is not None
    assert loose.predicted_ttft_decode_s < 1.0
    # The same request with a TTFT SLO its fastest schedule cannot meet: kept, and why.
    tight = deflect(d, RequestSLO(loose.predicted_ttft_decode_s * 0.9, CONFIG.tbt_slo_s))
    assert (tight.route, tight.reason) == (Route.KEEP, Reason.KEEP_DECODE_OVER_SLO)


def test_a_loose_ttft_slo_keeps_a_request_the_keep_path_serves_in_time() -> None:
    # The gate weighs a deflection only from its share (25%) of the request's own TTFT SLO on:
    # a batch job whose keep path takes ~2.3 s of its 20 s needs no deflection.
    kept = deflect(node(), RequestSLO(20.0, 0.150))
    assert (kept.route, kept.reason) == (Route.KEEP, Reason.KEEP_SLO_ROOM)


def test_a_batch_request_plans_an_interactive_node_to_the_interactive_tau() -> None:
    # A TTFT SLO the keep path (~2.3 s) misses: the decode pressure rule does not apply.
    slo = RequestSLO(2.0, 0.150)
    loose = deflect(node(tpot=None), slo)
    tight = deflect(node(tpot=0.060), slo)
    assert loose.route is tight.route is Route.DEFLECT
    assert max(loose.predicted_step_s) > 0.060  # its own tau lets it take longer steps alone
    assert max(tight.predicted_step_s) <= 0.060 + 1e-12  # beside interactive decodes, theirs holds
    assert len(tight.chunk_sizes) > len(loose.chunk_sizes)
    # Each carries the budget it was planned to: a node that cannot tighten it is held to the line.
    assert (loose.step_budget_s, tight.step_budget_s) == (pytest.approx(0.150), pytest.approx(0.060))


def test_an_interactive_request_plans_any_node_to_its_own_tau() -> None:
    slo = RequestSLO(2.0, 0.060)
    on_batch_node = deflect(node(tpot=0.150), slo)
    assert on_batch_node.route is Route.DEFLECT
    assert max(on_batch_node.predicted_step_s) <= 0.060 + 1e-12
    assert on_batch_node.step_budget_s == pytest.approx(0.060)
    assert alg.node_step_budget_s(alg.with_request_slo(CONFIG, slo), node(tpot=0.150)) == pytest.approx(0.060)


def test_an_interactive_request_is_not_deflected_where_its_tpot_cannot_hold() -> None:
    # 12 decodes: a decode-only step of 52 ms, over a 50 ms TPOT: no chunk can join them.
    d = node(b=12)
    assert deflect(d, RequestSLO(4.0, 0.070)).route is Route.DEFLECT
    kept = deflect(d, RequestSLO(4.0, 0.050))
    assert (kept.route, kept.reason) == (Route.KEEP, Reason.KEEP_DECODE_OVERLOADED)
    # ... nor a batch request onto that node once an interactive decode runs there.
    beside = deflect(node(b=12, tpot=0.050), RequestSLO(4.0, 0.150))
    assert (beside.route, beside.reason) == (Route.KEEP, Reason.KEEP_DECODE_OVERLOADED)


def test_the_search_memo_tells_nodes_apart_by_their_tpot() -> None:
    # Two nodes in the same state but for their tightest TPOT: the looser one wins for a batch
    # request (its schedule is faster), and its plan is not the tighter node's.
    nodes = (node(tpot=0.050, node_id="d1"), node(tpot=None, node_id="d2"))
    d = decide(PROMPT, view((BUSY_PREFILL,), nodes), 0.0, MODELS, CONFIG, slo=RequestSLO(4.0, 0.150))
    assert d.decode_node == "d2" and max(d.predicted_step_s) > 0.050


def test_slo_off_decides_by_the_cluster_slo() -> None:
    on, off = create_policy("kairos", MODELS, CONFIG), create_policy("kairos:slo=off", MODELS, CONFIG)
    assert off.label.endswith(",slo=off)") and "slo" not in on.label
    v = view((BUSY_PREFILL,), (node(),))
    slo = RequestSLO(20.0, 0.150)
    assert on.decide(PROMPT, v, 0.0, slo=slo).route is Route.KEEP  # type: ignore[call-arg]
    assert off.decide(PROMPT, v, 0.0, slo=slo) == decide(PROMPT, v, 0.0, MODELS, CONFIG)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------
# The node's side: its guard and what it reports
# ---------------------------------------------------------------------------------------------
def test_tau_scaled_budget() -> None:
    assert tau_scaled_budget_s(None, 0.1, 0.05) is None
    assert tau_scaled_budget_s(0.15, 0.15, None) == 0.15  # no decode running
    assert tau_scaled_budget_s(0.15, 0.15, 0.20) == 0.15  # looser decodes: its own
    assert tau_scaled_budget_s(0.15, 0.15, 0.05) == pytest.approx(0.05)
    assert tau_scaled_budget_s(0.14, None, 0.035) == pytest.approx(0.07)  # none of its own: the default's
    assert tightest_tpot_s([]) is None
    assert tightest_tpot_s([0.15, None, 0.2]) == defaults.TBT_SLO_S


@pytest.mark.parametrize(("decode_tpot", "chunk"), [(0.150, 1090), (0.050, 90)])
def test_the_node_guard_holds_a_chunk_to_its_running_decodes_tpot(decode_tpot: float, chunk: int) -> None:
    engine = Engine(EngineConfig("d1", c.Role.DECODE, 4096, 1_000_000), model_step_time(MODELS), MODELS)
    running = EngineSeq("r", 10, 100, tpot_slo_s=decode_tpot)
    engine.accept_transferred(running, reserved_tokens=0)
    assert engine.plan_step(0.0) is not None  # it joins the batch
    engine.finish_step(engine.plan_step(0.0), 0.05, 0.05)  # type: ignore[arg-type]
    # A batch deflection planned to its own 150 ms: beside one decode, 0.041 + 1e-4 p.
    engine.submit(EngineSeq("x", 2000, 5, schedule=(2000,), step_budget_s=0.150, tpot_slo_s=0.150))
    plan = engine.plan_step(0.1)
    assert plan is not None and plan.chunks[0].tokens == chunk
    assert engine.snapshot().tpot_slo_s == min(decode_tpot, 0.150)


def test_an_engine_reports_the_tightest_tpot_of_its_requests_in_flight() -> None:
    engine = Engine(EngineConfig("d1", c.Role.DECODE, 4096, 1_000_000), model_step_time(MODELS), MODELS)
    assert engine.snapshot().tpot_slo_s is None
    engine.submit(EngineSeq("a", 100, 5, tpot_slo_s=0.150))
    assert engine.snapshot().tpot_slo_s == 0.150
    engine.submit(EngineSeq("b", 100, 5))  # none of its own: the cluster's default
    assert engine.snapshot().tpot_slo_s == defaults.TBT_SLO_S


def test_the_view_tightens_a_node_by_the_dispatches_since_its_heartbeat() -> None:
    tracker = ClusterTracker()
    tracker.update_decode(node(tpot=0.150))
    tracker.update_prefill(BUSY_PREFILL)
    assert tracker.view().decode[0].tpot_slo_s == 0.150
    d = deflect(node(tpot=0.150), RequestSLO(4.0, 0.060))
    assert d.route is Route.DEFLECT
    tracker.record(d, 0.01)
    assert tracker.view().decode[0].tpot_slo_s == 0.060
    keep = Decision(
        Route.KEEP, Reason.KEEP_POLICY, "d1", "p1", (), 0.5, None, PROMPT, predicted_prefill_end_s=0.5,
        slo=RequestSLO(1.0, 0.040),
    )  # fmt: skip
    tracker.record(keep, 0.02)
    assert tracker.view().decode[0].tpot_slo_s == 0.040
    # A heartbeat after both: the deflection shows on the node; the keep is still on its way.
    tracker.update_decode(DecodeNodeState("d1", 5, 5000, 10**7, reported_at=0.1, tpot_slo_s=0.060))
    assert tracker.view().decode[0].tpot_slo_s == 0.040
    tracker.update_decode(DecodeNodeState("d1", 5, 5000, 10**7, reported_at=0.6, tpot_slo_s=None))
    assert tracker.view().decode[0].tpot_slo_s is None


def test_the_heartbeat_carries_the_tightest_tpot() -> None:
    hb = c.parse_heartbeat(heartbeat_json("d1", tpot_slo_ms=60))
    assert hb.tpot_slo_ms == 60.0
    assert c.parse_heartbeat(c.encode_heartbeat(hb)).tpot_slo_ms == 60.0
    assert c.parse_heartbeat(heartbeat_json("d1")).tpot_slo_ms is None
    for bad in (0, -1, "60", True, math.inf):
        raw = (
            heartbeat_json("d1", tpot_slo_ms=bad)
            if bad != math.inf
            else heartbeat_json("d1").replace("}", ',"tpot_slo_ms":1e999}')
        )
        with pytest.raises(c.MalformedHeartbeat, match="tpot_slo_ms"):
            c.parse_heartbeat(raw)


def test_the_engine_state_and_the_xarg_carry_it() -> None:
    state = c.EngineState(1, 10, 100, (), (), 512, "m", tpot_slo_ms=150.0)
    assert c.parse_engine_state(c.encode_engine_state(state)).tpot_slo_ms == 150.0
    with pytest.raises(c.EngineStateError):
        c.EngineState(1, 10, 100, (), (), 512, "m", tpot_slo_ms=0.0)
    assert c.parse_tpot_xarg({c.XARG_TPOT_SLO_MS: 60}) == pytest.approx(0.06)
    assert c.parse_tpot_xarg({}) is None and c.parse_tpot_xarg(None) is None
    for bad in (0, -3, "60", False, math.nan):
        with pytest.raises(c.MalformedSchedule, match=c.XARG_TPOT_SLO_MS):
            c.parse_tpot_xarg({c.XARG_TPOT_SLO_MS: bad})


# ---------------------------------------------------------------------------------------------
# The mixed-class workload and per-class figures in the simulator
# ---------------------------------------------------------------------------------------------
def test_the_class_mix_is_seeded_and_shared_out() -> None:
    reqs = make_class_mix("interactive_batch", rps=4.0, duration_s=600, seed=3)
    assert reqs == make_class_mix("interactive_batch", rps=4.0, duration_s=600, seed=3)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    interactive = [r for r in reqs if r.request_id.startswith("interactive-")]
    assert all((r.ttft_slo_s, r.tpot_slo_s, r.priority) == (1.0, 0.060, 0) for r in interactive)
    assert all((r.ttft_slo_s, r.tpot_slo_s, r.priority) == (20.0, 0.150, 1) for r in reqs if r not in interactive)
    assert 0.25 < len(interactive) / len(reqs) < 0.35
    with pytest.raises(ValueError, match="unknown SLO class mix"):
        make_class_mix("nope", rps=1.0, duration_s=10)


def test_the_simulator_judges_each_request_by_its_own_slos_per_class() -> None:
    reqs = make_class_mix("interactive_batch", rps=3.0, duration_s=120, seed=1)
    runs = {
        spec: Simulator(reqs, create_policy(spec, MODELS), MODELS, ClusterConfig()).run().summary
        for spec in ("pd", "kairos")
    }
    for summary in runs.values():
        per_class = summary["per_class"]
        assert set(per_class) == {"interactive", "batch"}
        assert sum(k["requests"] for k in per_class.values()) == summary["requests"]
        total = sum(k["slo_attainment"] * k["requests"] for k in per_class.values())
        assert total == pytest.approx(summary["slo_attainment"] * summary["requests"])
    # A run whose requests carry no SLOs of their own has no per-class figures (nothing changes).
    plain = make_class_mix("interactive_batch", rps=3.0, duration_s=30, seed=1)
    plain = [type(r)(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in plain]
    assert "per_class" not in Simulator(plain, create_policy("kairos", MODELS), MODELS).run().summary


# ---------------------------------------------------------------------------------------------
# Under overload the loosest class waits longest and is shed first (the dispatcher's admission gate)
# ---------------------------------------------------------------------------------------------
INTERACTIVE, BATCH = RequestSLO(1.0, 0.060, 0), RequestSLO(20.0, 0.150, 1)


class _Full:
    """A one-node view whose running count a test changes, as heartbeats would."""

    def __init__(self, running: int) -> None:
        self.running = running

    def view(self) -> ClusterView:
        return ClusterView(decode=(DecodeNodeState("d0", self.running, 0, 10**9, 0.0),))


def _gate(cluster: _Full) -> tuple[AdmissionGate, DispatcherMetrics]:
    metrics = DispatcherMetrics()
    limits = AdmissionLimits(seats_per_decode_node=4, queue_per_seat=0.0, max_wait_s=5.0, waiting_per_seat=0.5)
    return AdmissionGate(cluster.view, metrics, limits, poll_s=0.001), metrics  # seats 4, a line of 2


async def test_a_tighter_request_displaces_the_loosest_waiter_and_goes_first() -> None:
    cluster = _Full(running=4)
    g, metrics = _gate(cluster)
    order: list[str] = []

    async def request(name: str, slo: RequestSLO) -> None:
        async with g.slot(10, slo):
            order.append(name)

    batch = [asyncio.create_task(request(f"batch{i}", BATCH)) for i in range(2)]
    while g.waiting < 2:
        await asyncio.sleep(0.001)
    # The line is full: a batch request more is refused at once ...
    with pytest.raises(OverloadedError):
        await request("batch2", BATCH)
    # ... and an interactive one takes the place of the latest batch waiter, which is refused.
    interactive = asyncio.create_task(request("interactive", INTERACTIVE))
    done, _ = await asyncio.wait(batch, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
    assert [t for t in batch if t in done] == [batch[1]] and isinstance(batch[1].exception(), OverloadedError)
    assert metrics.shed.labels(reason="queue_full")._value.get() == 2
    cluster.running = 3  # one seat frees: the interactive request has it, though it came last
    while not order:
        await asyncio.sleep(0.001)
    assert order == ["interactive"]
    cluster.running = 2
    await asyncio.wait_for(asyncio.gather(interactive, batch[0]), 5.0)
    assert order == ["interactive", "batch0"]
    g.close()


async def test_the_line_lets_the_tighter_class_in_first_and_each_class_in_arrival_order() -> None:
    cluster = _Full(running=4)
    metrics = DispatcherMetrics()
    limits = AdmissionLimits(seats_per_decode_node=4, queue_per_seat=0.0, max_wait_s=5.0, waiting_per_seat=2.0)
    g = AdmissionGate(cluster.view, metrics, limits, poll_s=0.001)
    order: list[str] = []

    async def request(name: str, slo: RequestSLO | None) -> None:
        async with g.slot(10, slo):
            order.append(name)

    tasks = []
    for name, slo in (("default0", None), ("batch0", BATCH), ("interactive0", INTERACTIVE), ("default1", None)):
        tasks.append(asyncio.create_task(request(name, slo)))
        while g.waiting < len(tasks):
            await asyncio.sleep(0.001)
    cluster.running = 0  # every seat frees at once
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert order == ["interactive0", "default0", "default1", "batch0"]
    g.close()
