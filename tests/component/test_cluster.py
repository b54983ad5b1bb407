"""RedisClusterView against a real redis-server: the wiring of the poller around the membership
rules (tests/unit/test_membership.py holds the rules themselves, as tables): live publishers to
view, key expiry, a Redis restart, SCAN cadence, the static fallback's start and end, TTFT
feedback reads, and reservations raced by two OS processes.

Tests that need exact ages drive ``poll_once()`` by hand with a fake clock; the others run the
background poller with 10 ms polls beside real publishers beating every 20 ms."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from kairos.common.aio import cancel_and_wait
from kairos.common.contracts import (
    REDIS_PROMISE_CHANNEL,
    REDIS_TTFT_FEEDBACK_STREAM,
    TTFT_FEEDBACK_FIRST_TOKEN,
    TtftFeedbackField,
)
from kairos.common.errors import NoHealthyNodeError
from kairos.core.algorithm import DeciderConfig, can_take_deflection
from kairos.core.decision import Decision, Reason, Route
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.extproc.cluster import ClusterViewConfig, RedisClusterView
from kairos.extproc.feedback import TtftFeedback
from kairos.extproc.membership import MembershipConfig, NodeAddress
from kairos.extproc.metrics import DispatcherMetrics, reservations_forged_counter
from kairos.extproc.reservations import Reservation, ReservationClient
from kairos.nodeagent.heartbeat import EngineState, HeartbeatPublisher, PublisherConfig
from tests.builders import heartbeat_json as beat
from tests.builders import queue_load
from tests.redis_server import RedisServer
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "kairos.extproc"  # the poller, the reservation client and the feedback reader log under it
ERRORS = "kairos_dispatcher_redis_errors_total"


@pytest.fixture
async def client(redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis.url)
    yield c
    await c.aclose()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGER) and text in r.getMessage()]


def errors(registry: CollectorRegistry, operation: str) -> float:
    return registry.get_sample_value(ERRORS, {"operation": operation}) or 0.0


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------------
# Publishers with in-process engines
# ---------------------------------------------------------------------------------------------
def engine(
    b: int = 0, k: int = 0, queue: tuple[int, ...] = (), scheduled: tuple[int, ...] = (), chunk: int = 2048
) -> EngineState:
    return EngineState(b, k, 100_000, queue, scheduled, chunk, "tiny-llama")


class Source:
    def __init__(self, state: EngineState) -> None:
        self.state = state

    async def read(self) -> EngineState:
        return self.state


@dataclass
class Node:
    publisher: HeartbeatPublisher
    source: Source
    task: asyncio.Task[None]

    async def crash(self) -> None:
        await cancel_and_wait(self.task)


PUBLISHED = {
    "p0": ("prefill", "127.0.0.1:8001", "", engine(queue=(3000, 500), chunk=2048)),
    "p1": ("prefill", "127.0.0.1:8002", "", engine(queue=(), chunk=1024)),
    "d0": ("decode", "127.0.0.1:8101", "127.0.0.1:8201", engine(b=7, k=21_000, scheduled=(900,))),
    "d1": ("decode", "127.0.0.1:8102", "127.0.0.1:8202", engine(b=3, k=5_000)),
}


@pytest.fixture
async def nodes(redis: RedisServer) -> AsyncIterator[dict[str, Node]]:
    """Two prefill and two decode publishers beating every 20 ms (TTL 100 ms)."""
    out: dict[str, Node] = {}
    for node_id, (role, url, sidecar, state) in PUBLISHED.items():
        cfg = PublisherConfig(node_id, role, url, sidecar, redis.url, period_s=0.02, ttl_s=0.1, redis_timeout_s=2.0)
        source = Source(state)
        publisher = HeartbeatPublisher(cfg, source)
        out[node_id] = Node(publisher, source, asyncio.create_task(publisher.run()))
    yield out
    for node in out.values():
        if not node.task.done():
            await node.crash()


MEMBERSHIP_FIELDS = {
    "stale_after_s",
    "recovery_grace_s",
    "forget_malformed_after_s",
    "last_resort_s",
    "fallback_prefill",
    "fallback_decode",
}


def view_config(redis: RedisServer, **kw: Any) -> ClusterViewConfig:
    base: dict[str, Any] = {
        "redis_url": redis.url,
        "poll_s": 0.01,
        "stale_after_s": 0.06,
        "scan_every_polls": 2,
        "redis_timeout_s": 2.0,  # generous: tests that need Redis down stop it (refused at once)
        "recovery_grace_s": 0.3,
        "reservation_ttl_s": 0.05,
    }
    settings = {**base, **kw}
    membership = MembershipConfig(**{k: v for k, v in settings.items() if k in MEMBERSHIP_FIELDS})
    return ClusterViewConfig(**{k: v for k, v in settings.items() if k not in MEMBERSHIP_FIELDS}, membership=membership)


@pytest.fixture
async def live(redis: RedisServer, registry: CollectorRegistry) -> AsyncIterator[RedisClusterView]:
    view = RedisClusterView(view_config(redis), registry=registry)
    await view.start()
    yield view
    await view.stop()


def ids(view: ClusterView) -> tuple[list[str], list[str]]:
    return sorted(n.node_id for n in view.prefill), sorted(n.node_id for n in view.decode)


def by_id(view: ClusterView) -> dict[str, PrefillNodeState | DecodeNodeState]:
    return {n.node_id: n for n in (*view.prefill, *view.decode)}


def prefill_queue(view: RedisClusterView, node_id: str) -> tuple[int, int, int]:
    (node,) = [n for n in view.view().prefill if n.node_id == node_id]
    return queue_load(node)


# ---------------------------------------------------------------------------------------------
# Heartbeats to view
# ---------------------------------------------------------------------------------------------
async def test_view_shows_every_published_node_with_its_reported_load(
    nodes: dict[str, Node], live: RedisClusterView
) -> None:
    await live.wait_ready(2.0)
    await eventually(lambda: ids(live.view()) == (["p0", "p1"], ["d0", "d1"]), what="four nodes")
    now = live.now()
    got = by_id(live.view())
    p0, p1, d0, d1 = got["p0"], got["p1"], got["d0"], got["d1"]
    assert isinstance(p0, PrefillNodeState) and isinstance(p1, PrefillNodeState)
    assert isinstance(d0, DecodeNodeState) and isinstance(d1, DecodeNodeState)
    assert (queue_load(p0), p0.chunk_tokens) == (queue_load((3000, 500)), 2048)
    assert (queue_load(p1), p1.chunk_tokens) == ((0, 0, 0), 1024)
    assert (d0.decode_tokens, d0.kv_tokens, d0.kv_capacity_tokens, d0.prefill_backlog_tokens) == (
        7,
        21_000,
        100_000,
        (900,),
    )
    assert (d1.decode_tokens, d1.kv_tokens, d1.prefill_backlog_tokens) == (3, 5_000, ())
    assert all(0 <= now - n.reported_at < 0.5 for n in got.values())
    assert dict(live.addresses()) == {
        "p0": NodeAddress("prefill", "127.0.0.1:8001", "", "tiny-llama"),
        "p1": NodeAddress("prefill", "127.0.0.1:8002", "", "tiny-llama"),
        "d0": NodeAddress("decode", "127.0.0.1:8101", "127.0.0.1:8201", "tiny-llama"),
        "d1": NodeAddress("decode", "127.0.0.1:8102", "127.0.0.1:8202", "tiny-llama"),
    }
    assert not live.degraded and not live.static_fallback

    # A change of load shows up within a few polls; so do the heartbeats' new reported_at.
    nodes["d1"].source.state = engine(b=9, k=6_000, scheduled=(100, 200))
    nodes["p1"].source.state = engine(queue=(64,), chunk=1024)

    def updated() -> bool:
        v = by_id(live.view())
        d1, p1 = v["d1"], v["p1"]
        assert isinstance(d1, DecodeNodeState) and isinstance(p1, PrefillNodeState)
        return (d1.decode_tokens, d1.kv_tokens, d1.prefill_backlog_tokens, queue_load(p1)) == (
            9,
            6_000,
            (100, 200),
            queue_load((64,)),
        )

    await eventually(updated, what="new load in the view")
    await eventually(lambda: live.stale_node_ids() == (), what="no stale node")


async def test_view_overlays_own_dispatches_until_the_next_heartbeat(
    nodes: dict[str, Node], live: RedisClusterView
) -> None:
    await eventually(lambda: len(live.addresses()) == 4, what="four nodes")
    keep = Decision(Route.KEEP, Reason.KEEP_POLICY, "d1", "p1", (), 0.1, None, 333)
    live.record(keep, live.now())
    assert prefill_queue(live, "p1") == queue_load((333,))  # no await since record(): no poll in between
    # The next heartbeat of p1 (reported_at later than the dispatch) replaces the overlay.
    await eventually(lambda: prefill_queue(live, "p1") == (0, 0, 0), what="overlay expiry")


async def test_a_node_that_stops_beating_leaves_the_view_after_its_ttl(
    nodes: dict[str, Node], live: RedisClusterView, client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await eventually(lambda: len(live.addresses()) == 4, what="four nodes")
    await nodes["p1"].crash()
    # Its key lives on until it expires, and so does p1 in the view. A TTL of seconds instead of
    # the publishers' 100 ms makes "not before" observable without racing a starved host's clock
    # (a key that expired already makes the check below hold trivially, never fail falsely).
    await client.pexpire("kairos:node:p1", 2000)
    await eventually(lambda: "p1" not in live.addresses(), what="p1 gone")
    assert await client.exists("kairos:node:p1") == 0  # the view let p1 go only once Redis had
    assert ids(live.view()) == (["p0"], ["d0", "d1"])
    assert len(messages(caplog, "node p1 (prefill) left the view: its heartbeat key expired")) == 1

    # A clean stop deletes the key: the node leaves without waiting for the TTL.
    nodes["d1"].publisher.stop()
    await nodes["d1"].task
    await eventually(lambda: "d1" not in live.addresses(), what="d1 gone")
    assert ids(live.view()) == (["p0"], ["d0"])


async def test_degraded_mode_keeps_the_last_view_and_heals_when_redis_returns(
    redis: RedisServer,
    nodes: dict[str, Node],
    live: RedisClusterView,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await eventually(lambda: len(live.addresses()) == 4 and not live.stale_node_ids(), what="four fresh nodes")
    sizes: list[int] = []

    async def watch() -> None:
        while True:
            sizes.append(len(live.addresses()))
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        redis.stop()
        await eventually(lambda: live.degraded, what="degraded")
        assert errors(registry, "poll") >= 1
        # The last good view stays; its nodes age into staleness (keep routing only).
        await eventually(lambda: len(live.stale_node_ids()) == 4, what="all nodes stale")
        assert ids(live.view()) == (["p0", "p1"], ["d0", "d1"])
        assert not live.static_fallback
        assert (await live.try_reserve("d0", "me", 1)).granted is False  # never deflect on a guess
        failures = errors(registry, "poll")
        await eventually(lambda: errors(registry, "poll") >= failures + 3, what="more failed polls")
        warnings = messages(caplog, "redis unreachable at redis://127.0.0.1:")
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "falling back to last view of 4 nodes (2 prefill, 2 decode)" in warnings[0].getMessage()

        redis.start()
        await eventually(lambda: not live.degraded, what="recovered")
        await eventually(lambda: not live.stale_node_ids(), what="fresh heartbeats after the restart")
        assert ids(live.view()) == (["p0", "p1"], ["d0", "d1"])
        assert len(messages(caplog, "answers again")) == 1
        assert len(messages(caplog, "redis unreachable")) == 1
        assert (await live.try_reserve("d0", "me", 1)).granted is True
    finally:
        watcher.cancel()
    assert min(sizes) == 4  # the view never lost a node, not even while Redis restarted empty


async def test_new_nodes_are_found_by_the_periodic_scan_and_gone_keys_at_the_next_poll(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    clock = FakeClock()
    # view_config's generous Redis timeout matters here: a timed-out poll reconnects, and a
    # reconnect rescans at once.
    config = view_config(redis, scan_every_polls=3, last_resort_s=0)
    view = RedisClusterView(config, clock=clock, registry=registry)
    try:
        await view.poll_once()  # poll 1 scans: nothing there
        await client.set("kairos:node:p0", beat("p0", seq=1))
        await view.poll_once()  # polls 2 and 3 only MGET the keys already known
        await view.poll_once()
        assert "p0" not in view.addresses()
        await view.poll_once()  # poll 4 scans again
        assert "p0" in view.addresses()
        await client.delete("kairos:node:p0")
        await view.poll_once()  # no scan, but MGET shows the key is gone
        assert view.view() == ClusterView()
    finally:
        await view.stop()


async def test_each_poll_reports_its_cost_and_the_oldest_heartbeat_it_found(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    """kairos_dispatcher_view_oldest_heartbeat_seconds: the view's worst staleness, taken just
    before each poll's update (ages by this view's clock); the poll's own time beside it."""
    clock = FakeClock()
    view = RedisClusterView(view_config(redis, last_resort_s=0), clock=clock, registry=registry)
    oldest = "kairos_dispatcher_view_oldest_heartbeat_seconds"
    try:
        await client.set("kairos:node:p0", beat("p0", seq=1))
        await client.set("kairos:node:d0", beat("d0", seq=1))
        await view.poll_once()  # both join; the view was empty before: no age to report
        assert registry.get_sample_value(f"{oldest}_count") == 0
        clock.t += 0.25
        await client.set("kairos:node:d0", beat("d0", seq=2))
        await view.poll_once()  # before this update both beats were 0.25 s old
        clock.t += 0.1
        await view.poll_once()  # p0's beat is 0.35 s old; d0's new one 0.1 s
        assert registry.get_sample_value(f"{oldest}_count") == 2
        assert registry.get_sample_value(f"{oldest}_sum") == pytest.approx(0.25 + 0.35)
        assert registry.get_sample_value(f"{oldest}_bucket", {"le": "0.3"}) == 1
        for part in ("poll", "read", "apply_wait"):  # the whole poll, its Redis read, its wait for the loop
            assert registry.get_sample_value(f"kairos_dispatcher_view_{part}_seconds_count") == 3
    finally:
        await view.stop()


async def test_each_poll_reports_how_long_after_its_sent_at_the_oldest_new_heartbeat_entered_the_view(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    """kairos_dispatcher_view_read_delay_seconds: at each poll that took new beats, the largest
    time from a beat's sent_at to this poll (by the wall clock, the one sent_at is on)."""
    wall = FakeClock(1000.0)
    view = RedisClusterView(view_config(redis), clock=FakeClock(), registry=registry, wall_clock=wall)
    delay = "kairos_dispatcher_view_read_delay_seconds"
    try:
        await client.set("kairos:node:p0", beat("p0", seq=1, sent_at=999.98))
        await client.set("kairos:node:d0", beat("d0", seq=1, sent_at=999.9))
        await view.poll_once()  # both new: the older counts, 0.1 s
        wall.t = 1000.05
        await view.poll_once()  # nothing new: nothing observed
        await client.set("kairos:node:d0", beat("d0", seq=2, sent_at=1000.02))
        wall.t = 1000.06
        await view.poll_once()
        assert registry.get_sample_value(f"{delay}_count") == 2
        assert registry.get_sample_value(f"{delay}_sum") == pytest.approx(0.1 + 0.04)
        assert registry.get_sample_value(f"{delay}_bucket", {"le": "0.05"}) == 1
    finally:
        await view.stop()


async def test_the_poll_reads_redis_while_the_event_loop_is_busy(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    """The background poll's slots and reads run on its own thread: a loop busy with requests
    (here: blocked outright) delays only the update, which lands once the loop is free (the
    thread reads again only after that: one poll at a time)."""
    view = RedisClusterView(view_config(redis), registry=registry)
    read = view._read
    reads: list[bool] = []
    thread_read = threading.Event()

    def counting_read(scan: bool, known: list[str]) -> tuple[list[str], list[bytes | None]]:
        got = read(scan, known)
        reads.append(scan)
        if len(reads) >= 2:  # start()'s own poll, then the poll thread's
            thread_read.set()
        return got

    view._read = counting_read  # type: ignore[method-assign]
    await client.set("kairos:node:d0", beat("d0", seq=1))
    await view.start()
    try:
        await client.set("kairos:node:d0", beat("d0", seq=2, decode_tokens=7))
        assert thread_read.wait(timeout=30)  # blocks this loop: no await until the thread has read
        await eventually(lambda: [n.decode_tokens for n in view.view().decode] == [7], what="the update")
        await eventually(lambda: len(reads) >= 3, what="the next read, after the update")
        assert (registry.get_sample_value("kairos_dispatcher_view_poll_lateness_seconds_count") or 0) >= 2
    finally:
        await view.stop()
    assert not view.running


# ---------------------------------------------------------------------------------------------
# Heartbeat values written straight into Redis
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Static fallback
# ---------------------------------------------------------------------------------------------
async def test_static_fallback_when_redis_was_never_up_is_plain_pd_routing(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = RedisServer()  # a free port, not started yet
    clock = FakeClock(100.0)
    cfg = view_config(
        server,
        fallback_prefill=("p0=127.0.0.1:8001", "p1=127.0.0.1:8002"),
        fallback_decode=("d0=127.0.0.1:8101+127.0.0.1:8201",),
        recovery_grace_s=0.5,
    )
    view = RedisClusterView(cfg, clock=clock, registry=registry)
    try:
        await view.poll_once()
        assert view.degraded and view.static_fallback
        static = ClusterView(
            prefill=(PrefillNodeState.from_queue("p0", (), 1, 100.0), PrefillNodeState.from_queue("p1", (), 1, 100.0)),
            decode=(DecodeNodeState("d0", 0, 0, 0, 100.0),),
        )
        assert view.view() == static
        assert view.address("d0") == NodeAddress("decode", "127.0.0.1:8101", "127.0.0.1:8201", "")
        assert view.address("p1") == NodeAddress("prefill", "127.0.0.1:8002", "", "")
        decider = DeciderConfig()
        assert not can_take_deflection(view.view().decode[0], 100.0, decider, 1)  # never a deflection target
        assert (await view.try_reserve("d0", "me", 1)).granted is False

        clock.t = 101.0  # each poll refreshes reported_at so the keep path treats them as live
        await view.poll_once()
        assert all(n.reported_at == 101.0 for n in (*view.view().prefill, *view.view().decode))
        assert errors(registry, "poll") == 2
        (warning,) = messages(caplog, "redis unreachable")
        assert "using the static node lists, 3 nodes (2 prefill, 1 decode): plain P/D routing" in warning.getMessage()

        # Redis comes up with heartbeats for p0 and d9: they replace the static lists; the static
        # nodes missing from Redis stay (aging) for the recovery grace, then leave.
        server.start()
        async with aioredis.Redis.from_url(server.url) as c:
            await c.set("kairos:node:p0", beat("p0", 1, queued_prefill_tokens=[40]))
            await c.set("kairos:node:d9", beat("d9", 1, role="decode"))
        clock.t = 102.0
        await view.poll_once()
        assert not view.degraded and not view.static_fallback
        got = by_id(view.view())
        assert got["p0"] == PrefillNodeState.from_queue("p0", (40,), 512, 102.0)
        assert got["d9"] == DecodeNodeState("d9", 0, 0, 50_000, 102.0)  # idle: no TPOT in flight
        assert got["p1"].reported_at == 101.0 and got["d0"].reported_at == 101.0
        clock.t = 102.5
        await view.poll_once()
        assert ids(view.view()) == (["p0"], ["d9"])
        assert len(messages(caplog, "left the view: it is a static node and redis now answers")) == 2
    finally:
        await view.stop()
        server.close()


async def test_without_static_nodes_or_redis_the_view_is_empty_and_not_ready(registry: CollectorRegistry) -> None:
    server = RedisServer()  # never started
    view = RedisClusterView(view_config(server), registry=registry)
    try:
        await view.start()
        assert view.degraded and not view.static_fallback and view.view() == ClusterView()
        with pytest.raises(NoHealthyNodeError, match="0 prefill and 0 decode nodes known"):
            await view.wait_ready(0.05)
    finally:
        await view.stop()
        server.close()


# ---------------------------------------------------------------------------------------------
# TTFT feedback from the sidecars' stream
# ---------------------------------------------------------------------------------------------
RATIO = "kairos_dispatcher_ttft_observed_over_predicted"
MAPE = "kairos_dispatcher_ttft_prediction_mape"


def feedback_fields(path: str, predicted_ms: float, observed_ms: float, rid: str = "r") -> dict[str, str]:
    f = TtftFeedbackField
    return {
        f.REQUEST_ID: rid,
        f.PATH: path,
        f.NODE: "d0",
        f.PREDICTED_MS: str(predicted_ms),
        f.OBSERVED_MS: str(observed_ms),
        f.MEASURED: TTFT_FEEDBACK_FIRST_TOKEN,
    }


def feedback_view(redis: RedisServer, registry: CollectorRegistry) -> tuple[RedisClusterView, DispatcherMetrics]:
    metrics = DispatcherMetrics(registry)
    view = RedisClusterView(view_config(redis), registry=registry, feedback=TtftFeedback(metrics, window=200))
    return view, metrics


async def decode_node_d0(redis: RedisServer) -> None:
    """d0 in the view: a feedback entry must name a decode node the dispatcher knows."""
    client = aioredis.Redis.from_url(redis.url)
    try:
        await client.set("kairos:node:d0", beat("d0", 1))
    finally:
        await client.aclose()


def ratio_count(registry: CollectorRegistry, path: str) -> float:
    return registry.get_sample_value(f"{RATIO}_count", {"path": path}) or 0.0


async def test_feedback_entries_added_after_start_show_in_the_metrics(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    # An entry from before the dispatcher started: skipped, as XREAD from "$" would.
    await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 900))
    await decode_node_d0(redis)
    view, _ = feedback_view(redis, registry)
    try:
        await view.poll_once()
        assert ratio_count(registry, "keep") == 0
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 150))  # error 1/3
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 300, 200))  # error 1/2
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("deflect", 400, 500))  # error 1/5
        await view.poll_once()
        assert (ratio_count(registry, "keep"), ratio_count(registry, "deflect")) == (2, 1)
        assert registry.get_sample_value(MAPE, {"path": "keep"}) == pytest.approx((1 / 3 + 1 / 2) / 2)
        assert registry.get_sample_value(MAPE, {"path": "deflect"}) == pytest.approx(0.2)
        await view.poll_once()  # nothing new: nothing counted twice
        assert (ratio_count(registry, "keep"), ratio_count(registry, "deflect")) == (2, 1)
        # The background poller reads them too.
        await view.start()
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("deflect", 100, 100))
        await eventually(lambda: ratio_count(registry, "deflect") == 2, what="the polled entry")
        assert registry.get_sample_value(MAPE, {"path": "deflect"}) == pytest.approx(0.1)
        assert errors(registry, "feedback") == 0
    finally:
        await view.stop()


async def test_feedback_pauses_while_redis_is_down_and_resumes_after(
    redis: RedisServer, registry: CollectorRegistry
) -> None:
    await decode_node_d0(redis)
    view, _ = feedback_view(redis, registry)
    writer = aioredis.Redis.from_url(redis.url)
    try:
        await view.poll_once()
        await writer.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 200))
        await view.poll_once()
        assert ratio_count(registry, "keep") == 1
        redis.stop()
        await view.poll_once()
        await view.poll_once()
        assert view.degraded and errors(registry, "poll") == 2
        assert errors(registry, "feedback") == 0  # a failed poll does not read the stream at all
        assert registry.get_sample_value(MAPE, {"path": "keep"}) == pytest.approx(0.5)  # the last value stays
        redis.start()  # back empty: new entries get later ids than the last one read
        await writer.aclose()
        writer = aioredis.Redis.from_url(redis.url)  # the old one's connection died with the server
        await writer.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 100))
        await view.poll_once()  # d0's key is gone with the restart; the recovery grace keeps it in the view
        assert not view.degraded and ratio_count(registry, "keep") == 2
        assert registry.get_sample_value(MAPE, {"path": "keep"}) == pytest.approx(0.25)
    finally:
        await writer.aclose()
        await view.stop()


async def test_feedback_naming_no_decode_node_in_the_view_never_reaches_the_mape(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    await decode_node_d0(redis)
    view, _ = feedback_view(redis, registry)
    try:
        await view.poll_once()
        junk = {**feedback_fields("keep", 100, 100), TtftFeedbackField.NODE: "d9"}
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, junk)
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 10_000_000, 1))  # beyond bounds
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 200))
        await view.poll_once()
        assert ratio_count(registry, "keep") == 1
        assert registry.get_sample_value(MAPE, {"path": "keep"}) == pytest.approx(0.5)
        assert registry.get_sample_value("kairos_dispatcher_ttft_feedback_malformed_total") == 2
    finally:
        await view.stop()


async def test_a_failing_feedback_read_never_degrades_the_view(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await client.set("kairos:node:p0", beat("p0", 1))
    await client.set(REDIS_TTFT_FEEDBACK_STREAM, "not a stream")  # XREAD answers WRONGTYPE
    await decode_node_d0(redis)
    view, _ = feedback_view(redis, registry)
    try:
        await view.poll_once()
        await view.poll_once()
        assert not view.degraded and ids(view.view()) == (["p0"], ["d0"])
        assert errors(registry, "feedback") == 2 and errors(registry, "poll") == 0
        assert len(messages(caplog, "cannot read the TTFT feedback stream kairos:ttft-feedback")) == 1
        await client.delete(REDIS_TTFT_FEEDBACK_STREAM)
        await view.poll_once()  # the stream's end is found now (it never was): reading starts there
        assert len(messages(caplog, "reading the TTFT feedback stream kairos:ttft-feedback again")) == 1
        await client.xadd(REDIS_TTFT_FEEDBACK_STREAM, feedback_fields("keep", 100, 100))
        await view.poll_once()
        assert ratio_count(registry, "keep") == 1
    finally:
        await view.stop()


async def test_a_slow_feedback_read_never_holds_back_the_heartbeat_polls(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    """The feedback read is a round trip on the event loop, after a poll's update: while one
    hangs, the polls go on (and the read runs again, once, when it is free)."""
    await decode_node_d0(redis)
    view, _ = feedback_view(redis, registry)
    assert view._feedback is not None
    read_feedback = view._feedback.read
    release = asyncio.Event()
    feedback_reads: list[int] = []

    async def slow_read(redis_client: aioredis.Redis) -> None:
        feedback_reads.append(len(feedback_reads))
        if len(feedback_reads) == 2:  # the background poller's first: hangs until released
            await release.wait()
        await read_feedback(redis_client)

    view._feedback.read = slow_read  # type: ignore[method-assign]
    await view.start()  # start()'s own poll reads the feedback once
    try:
        await eventually(lambda: len(feedback_reads) == 2, what="the hanging feedback read")
        for seq in (2, 3):
            await client.set("kairos:node:d0", beat("d0", seq, decode_tokens=seq))
            await eventually(lambda seq=seq: [n.decode_tokens for n in view.view().decode] == [seq], what="a poll")
        assert len(feedback_reads) == 2  # no second read while the first hangs
        release.set()
        await eventually(lambda: len(feedback_reads) >= 3, what="the read, once more")
    finally:
        await view.stop()


async def test_without_feedback_the_stream_is_not_read(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    await client.set(REDIS_TTFT_FEEDBACK_STREAM, "not a stream")
    view = RedisClusterView(view_config(redis), registry=registry)
    try:
        await view.poll_once()
        assert errors(registry, "feedback") == 0 and not view.degraded
    finally:
        await view.stop()


# ---------------------------------------------------------------------------------------------
# Reservations: promises of deflected tokens (extproc/reservations.py)
# ---------------------------------------------------------------------------------------------
def promises(registry: CollectorRegistry, ttl_ms: int = 300) -> ReservationClient:
    return ReservationClient(ttl_ms, lambda: None, "test", reservations_forged_counter(registry).inc)


async def test_a_promise_counts_other_dispatchers_promises_and_never_its_own(
    client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    r = promises(registry)
    # One dispatcher may promise one node several deflections: each decision counted its own.
    for _ in range(3):
        assert await r.try_reserve(client, "d0", "dispatcher-a", 500, known_tokens=0, since_s=0.3) == Reservation(True)
    assert await client.zcard("kairos:reserve:d0") == 3
    assert 0 < await client.pttl("kairos:reserve:d0") <= 300
    # Another dispatcher that counted none of them is refused, and told what they are.
    refused = await r.try_reserve(client, "d0", "dispatcher-b", 700, known_tokens=0, since_s=0.3)
    assert not refused.granted
    assert [p.tokens for p in refused.foreign] == [500, 500, 500]
    assert all(0 <= p.age_s <= 0.3 for p in refused.foreign)
    # Counting them, it is granted; and now dispatcher-a must count dispatcher-b's 700.
    assert (await r.try_reserve(client, "d0", "dispatcher-b", 700, known_tokens=1500, since_s=0.3)).granted
    again = await r.try_reserve(client, "d0", "dispatcher-a", 100, known_tokens=0, since_s=0.3)
    assert not again.granted and [p.tokens for p in again.foreign] == [700]
    assert (await r.try_reserve(client, "d0", "dispatcher-a", 100, known_tokens=700, since_s=0.3)).granted
    # Promises older than the caller's heartbeat (since_s) are in that heartbeat: not counted.
    assert (await r.try_reserve(client, "d0", "dispatcher-c", 1, known_tokens=0, since_s=0.0)).granted
    # Other nodes are independent.
    assert (await r.try_reserve(client, "d1", "dispatcher-b", 700, known_tokens=0, since_s=0.3)).granted


async def test_promises_lapse_after_their_ttl(client: aioredis.Redis, registry: CollectorRegistry) -> None:
    r = promises(registry, ttl_ms=50)
    assert (await r.try_reserve(client, "d0", "dispatcher-a", 500, known_tokens=0, since_s=10)).granted

    async def lapsed() -> bool:
        return not await client.exists("kairos:reserve:d0")

    await eventually(lapsed, what="d0's promises expired")
    assert (await r.try_reserve(client, "d0", "dispatcher-b", 500, known_tokens=0, since_s=10)).granted


async def _unparseable_now(c: aioredis.Redis) -> None:
    seconds, micros = await c.time()
    await c.zadd("kairos:reserve:d0", {"junk": seconds * 1000 + micros // 1000})


FORGERIES = {
    "a string key with no expiry": lambda c: c.set("kairos:reserve:d0", "attacker"),
    "a promise dated in 2096": lambda c: c.zadd("kairos:reserve:d0", {"attacker|1|1000000": 4e12}),
    "an unparseable member dated now": _unparseable_now,
}


@pytest.mark.parametrize("forgery", FORGERIES)
async def test_promises_no_dispatcher_wrote_are_removed_and_counted(
    client: aioredis.Redis, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture, forgery: str
) -> None:
    """A writer that holds kairos:reserve:d0 with a forged promise must not stop deflection to d0."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    await FORGERIES[forgery](client)
    r = promises(registry)
    assert await r.try_reserve(client, "d0", "dispatcher-b", 10, known_tokens=0, since_s=0.3) == Reservation(True)
    members = await client.zrange("kairos:reserve:d0", 0, -1)
    assert len(members) == 1 and members[0].startswith(b"dispatcher-b|")
    assert 0 < await client.pttl("kairos:reserve:d0") <= 300
    assert registry.get_sample_value("kairos_dispatcher_reservations_forged_total") == 1
    assert (await r.try_reserve(client, "d1", "dispatcher-b", 10, known_tokens=0, since_s=0.3)).granted
    await client.delete("kairos:reserve:d0")
    await FORGERIES[forgery](client)
    assert (await r.try_reserve(client, "d0", "dispatcher-b", 10, known_tokens=0, since_s=0.3)).granted
    assert registry.get_sample_value("kairos_dispatcher_reservations_forged_total") == 2
    assert len(messages(caplog, "promises no dispatcher writes")) == 1  # logged once


async def test_the_view_adds_other_dispatchers_promises_and_decides_again_on_them(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    clock = FakeClock()
    config = view_config(redis, reservation_ttl_s=0.3, last_resort_s=0)
    # Promises younger than d0's heartbeat age plus the grace are not in that heartbeat.
    view = RedisClusterView(config, ClusterTracker(dispatch_grace_s=0.2), clock=clock, registry=registry)
    other = RedisClusterView(config, registry=CollectorRegistry())
    try:
        assert await view.try_reserve("d0", "dispatcher-a", 100) == Reservation(False)  # not in the view
        await client.set("kairos:node:d0", beat("d0", seq=1))
        await view.poll_once()
        await other.poll_once()
        assert (await other.try_reserve("d0", "dispatcher-b", 800)).granted
        assert (await other.try_reserve("d0", "dispatcher-b", 300)).granted
        refused = await view.try_reserve("d0", "dispatcher-a", 100)
        assert not refused.granted and sorted(p.tokens for p in refused.foreign) == [300, 800]
        (d0,) = view.view().decode
        assert sorted(d0.prefill_backlog_tokens) == [300, 800]  # the next decision counts them
        assert (await view.try_reserve("d0", "dispatcher-a", 100)).granted
        # A heartbeat received well after them shows them: they leave the view.
        clock.t += 1.0
        await client.set("kairos:node:d0", beat("d0", seq=2))
        await view.poll_once()
        assert view.view().decode[0].prefill_backlog_tokens == ()
    finally:
        await view.stop()
        await other.stop()


async def subscribers(client: aioredis.Redis, n: int) -> bool:
    counts = dict(await client.pubsub_numsub(REDIS_PROMISE_CHANNEL))
    return counts.get(REDIS_PROMISE_CHANNEL.encode(), 0) >= n


def heard(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("kairos_dispatcher_promises_heard_total", {"outcome": outcome}) or 0.0


async def test_each_replica_hears_the_others_promises_as_they_are_made(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry
) -> None:
    """With both views running, a promise reaches the other replica's view before its next
    decision: it reserves the node at its first try instead of after a refusal."""
    config = view_config(redis, reservation_ttl_s=0.3, last_resort_s=0)
    await client.set("kairos:node:d0", beat("d0", seq=1))
    # A long grace: the polls' re-reads of d0's one beat never end a promise within the test.
    view = RedisClusterView(config, ClusterTracker(dispatch_grace_s=5.0), registry=registry)
    other = RedisClusterView(config, ClusterTracker(dispatch_grace_s=5.0), registry=CollectorRegistry())
    await view.start()
    await other.start()
    try:
        await eventually(lambda: subscribers(client, 2), what="both views subscribed to the promise channel")
        assert (await other.try_reserve("d0", "dispatcher-b", 800)).granted
        await eventually(lambda: view.tracker.foreign_tokens("d0") == 800, what="the promise heard")
        assert (await view.try_reserve("d0", "dispatcher-a", 100)).granted  # counted already: no refusal
        await eventually(lambda: other.tracker.foreign_tokens("d0") == 100, what="the answer heard")
        assert view.tracker.foreign_tokens("d0") == 800  # its own promise came back and was not counted
        assert view.view().decode[0].prefill_backlog_tokens == (800,)  # what its next decision schedules behind
        # What no dispatcher published, and promises onto nodes not in the view, change nothing.
        await client.publish(REDIS_PROMISE_CHANNEL, b"not a promise")
        await client.publish(REDIS_PROMISE_CHANNEL, json.dumps({"node": "d9", "promise": "dispatcher-c|1|5"}))
        await eventually(lambda: heard(registry, "malformed") == 1 and heard(registry, "ignored") == 2)
        assert heard(registry, "added") == 1 and view.tracker.foreign_tokens("d0") == 800
    finally:
        await view.stop()
        await other.stop()


async def test_the_promise_listener_comes_back_with_redis(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await client.set("kairos:node:d0", beat("d0", seq=1))
    config = view_config(redis, last_resort_s=0)
    view = RedisClusterView(config, ClusterTracker(dispatch_grace_s=5.0), registry=registry)
    await view.start()
    try:
        await eventually(lambda: subscribers(client, 1), what="the view subscribed")
        first_beat_at = view.tracker.reported_at("d0")
        redis.stop()
        await eventually(lambda: messages(caplog, "not hearing other dispatchers' promises"), what="the outage logged")
        redis.start()
        async with aioredis.Redis.from_url(redis.url) as again:
            await again.set("kairos:node:d0", beat("d0", seq=2))
            await eventually(lambda: subscribers(again, 1), what="the view subscribed again")
            await eventually(
                lambda: view.tracker.reported_at("d0") not in (None, first_beat_at), what="d0's new beat in the view"
            )
            await again.publish(REDIS_PROMISE_CHANNEL, json.dumps({"node": "d0", "promise": "dispatcher-b|1|64"}))
        await eventually(lambda: view.tracker.foreign_tokens("d0") == 64, what="a promise heard after the outage")
        assert len(messages(caplog, "not hearing other dispatchers' promises")) == 1  # once per outage
        back = [r for r in messages(caplog, "hearing other dispatchers' promises") if r.getMessage().endswith("again")]
        assert len(back) == 1
    finally:
        await view.stop()


async def test_a_promise_fails_closed_when_redis_is_down(
    redis: RedisServer, client: aioredis.Redis, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    view = RedisClusterView(view_config(redis, last_resort_s=0), registry=registry)
    try:
        for node_id in ("d0", "d1", "d2", "d3"):
            await client.set(f"kairos:node:{node_id}", beat(node_id, seq=1))
        await view.poll_once()
        assert (await view.try_reserve("d0", "me", 1)).granted
        redis.stop()
        assert await view.try_reserve("d1", "me", 1) == Reservation(False)
        assert await view.try_reserve("d2", "me", 1) == Reservation(False)
        assert errors(registry, "reserve") == 2
        assert len(messages(caplog, "for reservations")) == 1
        redis.start()
        assert (await view.try_reserve("d3", "me", 1)).granted
        assert len(messages(caplog, "takes reservations again")) == 1
    finally:
        await view.stop()


WORKER = r"""
import asyncio, json, random, sys, time
import redis.asyncio as aioredis
from kairos.extproc.reservations import ReservationClient

async def main(url, owner, seed, ttl_ms, race_s):
    client = aioredis.Redis.from_url(url)
    promises = ReservationClient(ttl_ms, lambda: None, "race")
    rng = random.Random(seed)
    await promises.try_reserve(client, "warm-up-" + owner, owner, 1, 0, 0)  # connect before the race
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    attempts, known = [], 0
    deadline = time.monotonic() + race_s  # a fixed time, not a count: a late start still overlaps
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.0, 0.002))
        sent = time.monotonic()
        r = await promises.try_reserve(client, "d0", owner, 1, known, ttl_ms / 1000)
        attempts.append((sent, time.monotonic(), r.granted, known))
        known = 0 if r.granted else sum(p.tokens for p in r.foreign)  # what the next decision counts
    await client.aclose()
    print(json.dumps(attempts), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
"""


async def test_two_dispatcher_processes_never_grant_a_promise_that_missed_the_others(redis: RedisServer) -> None:
    """Two processes promise one token each onto d0 as fast as they can. Every granted promise
    must have counted (``known``) every promise of the other process that was surely alive when
    it ran."""
    ttl_ms = 50
    race_s = 1.0  # each process races this long: many TTL windows, and a starved start still overlaps
    seeds = {"dispatcher-a": 1, "dispatcher-b": 2}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            redis.url,
            owner,
            str(seed),
            str(ttl_ms),
            str(race_s),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for owner, seed in seeds.items()
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 15.0) == b"ready\n"
        for proc in procs:  # start both races together
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        outputs = [await asyncio.wait_for(p.communicate(), 15.0) for p in procs]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert [p.returncode for p in procs] == [0, 0]
    attempts = {owner: json.loads(out) for owner, (out, _) in zip(seeds, outputs, strict=True)}
    spans = [(a[0][0], a[-1][1]) for a in attempts.values()]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # the two races overlapped in time

    ttl = ttl_ms / 1000
    grants = {o: [(sent, got, known) for sent, got, won, known in tries if won] for o, tries in attempts.items()}
    assert all(len(g) >= 2 for g in grants.values())
    checked = 0
    for owner, mine in grants.items():
        theirs = [(o_sent, o_got) for other, gs in grants.items() if other != owner for o_sent, o_got, _ in gs]
        for sent, got, known in mine:
            # Redis dated their promise between o_sent and o_got, and ran this one between sent
            # and got: it was written before this one ran, and still under the TTL when it ran.
            surely_alive = sum(1 for o_sent, o_got in theirs if o_got < sent and got - o_sent < ttl - 0.001)
            checked += surely_alive > 0
            assert surely_alive <= known, f"{owner} was granted at {sent:.4f} counting {known}, not {surely_alive}"
    assert checked >= 1  # some grant did have the other's promises to count
