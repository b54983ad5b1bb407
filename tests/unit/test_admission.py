"""Admission control: the pure budget (kairos.core.admission) and the dispatcher's gate that
applies it (kairos.extproc.admission): admit, wait in a bounded line, or refuse with a 429."""

from __future__ import annotations

import asyncio
import json

import pytest

from kairos.common.errors import ConfigError, OverloadedError
from kairos.common.http_errors import error_json, error_status
from kairos.core.admission import (
    AdmissionLimits,
    Verdict,
    admission,
    in_flight,
    kv_budget,
    kv_committed,
    max_waiting,
    request_budget,
)
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.extproc.admission import AdmissionGate
from kairos.extproc.metrics import DispatcherMetrics

LIMITS = AdmissionLimits(seats_per_decode_node=4, queue_per_seat=1.0, max_wait_s=0.5, waiting_per_seat=0.5)


def view(queued: tuple[int, ...] = (), running: int = 0, kv: int = 0, capacity: int = 10_000, **decode) -> ClusterView:
    """One prefill node holding ``queued`` prompts, two decode nodes: d0 as given, d1 idle."""
    return ClusterView(
        prefill=(PrefillNodeState.from_queue("p0", queued, 2048, 0.0),),
        decode=(
            DecodeNodeState("d0", running, kv, capacity, 0.0, **decode),
            DecodeNodeState("d1", 0, 0, capacity, 0.0),
        ),
    )


def test_in_flight_counts_each_place_a_request_can_be() -> None:
    v = view(queued=(100, 200), running=3, prefill_backlog_tokens=(50,), pending_kv_pull_tokens=(10, 20))
    assert in_flight(v) == 2 + 3 + 1 + 2


def test_budget_is_the_decode_seats_and_a_queue_as_deep() -> None:
    assert request_budget(view(), LIMITS) == 2 * 4 * 2
    assert max_waiting(view(), LIMITS) == 2 * 4 * 0.5
    assert request_budget(view(), AdmissionLimits(seats_per_decode_node=4, queue_per_seat=0.0)) == 8


def test_admits_below_the_budget_and_refuses_at_it() -> None:
    assert admission(view(queued=(10,) * 15), 10, LIMITS) is Verdict.ADMIT
    assert admission(view(queued=(10,) * 16), 10, LIMITS) is Verdict.OVER_REQUESTS
    # Requests admitted but not yet in the view count.
    assert admission(view(queued=(10,) * 15), 10, LIMITS, admitted_unseen=1) is Verdict.OVER_REQUESTS


def test_kv_budget_counts_held_promised_and_queued_prompts() -> None:
    v = view(queued=(1_000,), running=1, kv=30_000, capacity=20_000, incoming_keep_tokens=500)
    assert kv_committed(v) == 20_000 + 1_000  # d0 full (its free KV floors at 0), and the queued prompt
    assert kv_budget(v, LIMITS) == 2 * 20_000 * 2
    assert admission(v, 18_000, LIMITS) is Verdict.ADMIT
    assert admission(v, 60_000, LIMITS) is Verdict.OVER_KV


def test_a_lone_long_prompt_is_not_the_budgets_to_refuse() -> None:
    assert admission(view(capacity=100), 10_000, LIMITS) is Verdict.ADMIT


def test_no_decode_node_admits_routing_answers() -> None:
    empty = ClusterView(prefill=(PrefillNodeState.from_queue("p0", (10,) * 100, 2048, 0.0),))
    assert admission(empty, 10, LIMITS) is Verdict.ADMIT


@pytest.mark.parametrize(
    "kwargs",
    [{"seats_per_decode_node": 0}, {"queue_per_seat": -1.0}, {"max_wait_s": -0.1}, {"waiting_per_seat": float("inf")}],
)
def test_limits_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        AdmissionLimits(**kwargs)


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert AdmissionLimits(max_wait_s=0.2).retry_after_s == 1
    assert AdmissionLimits(max_wait_s=2.5).retry_after_s == 3


def test_overloaded_is_an_openai_429() -> None:
    exc = OverloadedError("full", 1)
    assert error_status(exc) == 429
    body = json.loads(error_json(exc))["error"]
    assert body["code"] == "overloaded" and body["type"] == "rate_limit_error" and body["message"] == "full"


# -- the gate ---------------------------------------------------------------------------------
class Cluster:
    """A view whose running count a test changes, as heartbeats would."""

    def __init__(self, running: int) -> None:
        self.running = running

    def view(self) -> ClusterView:
        return ClusterView(decode=(DecodeNodeState("d0", self.running, 0, 10**9, 0.0),))


def gate(cluster: Cluster, **limits: float) -> tuple[AdmissionGate, DispatcherMetrics]:
    metrics = DispatcherMetrics()
    settings = {"seats_per_decode_node": 4, "queue_per_seat": 0.0, "max_wait_s": 5.0, "waiting_per_seat": 1.0}
    return AdmissionGate(cluster.view, metrics, AdmissionLimits(**{**settings, **limits}), poll_s=0.001), metrics


def shed(metrics: DispatcherMetrics, reason: str) -> float:
    return metrics.shed.labels(reason=reason)._value.get()


async def test_requests_being_decided_hold_their_seats() -> None:
    cluster = Cluster(running=2)
    g, metrics = gate(cluster, max_wait_s=0.05)
    async with g.slot(10), g.slot(10):
        with pytest.raises(OverloadedError) as refused:  # 2 running + 2 being decided = 4 seats
            async with g.slot(10):
                pass
    assert refused.value.retry_after_s == 1
    assert shed(metrics, "wait_timeout") == 1
    async with g.slot(10):  # decided: their seats are the view's again
        pass


async def test_a_waiter_gets_the_first_seat_that_frees_in_order() -> None:
    cluster = Cluster(running=4)
    g, metrics = gate(cluster)
    order: list[int] = []

    async def request(i: int) -> None:
        async with g.slot(10):
            order.append(i)

    waiters = [asyncio.create_task(request(i)) for i in range(3)]
    while g.waiting < 3:
        await asyncio.sleep(0.001)
    assert order == [] and metrics.admission_waiting._value.get() == 3
    cluster.running = 2  # a heartbeat: two seats free
    while len(order) < 2:
        await asyncio.sleep(0.001)
    cluster.running = 3  # those two now run; one more seat
    await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
    assert order == [0, 1, 2]
    assert metrics.admission_waited._value.get() == 3
    assert shed(metrics, "queue_full") == shed(metrics, "wait_timeout") == 0


async def test_a_full_line_refuses_at_once() -> None:
    cluster = Cluster(running=4)
    g, metrics = gate(cluster, waiting_per_seat=0.5)  # a line of 2
    waiters = [asyncio.create_task(g.slot(10).__aenter__()) for _ in range(2)]
    while g.waiting < 2:
        await asyncio.sleep(0.001)
    with pytest.raises(OverloadedError):
        await g.slot(10).__aenter__()
    assert shed(metrics, "queue_full") == 1
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    g.close()


async def test_no_wait_refuses_at_once() -> None:
    g, metrics = gate(Cluster(running=4), max_wait_s=0.0)
    with pytest.raises(OverloadedError):
        await g.slot(10).__aenter__()
    assert shed(metrics, "queue_full") == 1


async def test_the_in_flight_gauges_say_what_the_view_holds_now_not_at_the_last_arrival() -> None:
    # After a burst the cluster drains with no request arriving: kairos top and the dashboard
    # must show it idle, not the count the last arrival saw.
    cluster = Cluster(running=3)
    g, metrics = gate(cluster)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"kairos_dispatcher_admission_{name}")

    async with g.slot(10):
        assert sample("in_flight") == 4  # 3 in the view, 1 being decided
    assert sample("in_flight") == 3
    cluster.running = 0  # heartbeats: the burst has drained
    assert sample("in_flight") == 0
    assert sample("budget") == 4  # one decode node's 4 seats, no queue
