"""The heartbeat publisher against a real redis-server, and HttpStateSource against a real
aiohttp server. Periods are 20 ms so the whole file runs in a few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from kairos.common.contracts import REDIS_HEARTBEAT_CHANNEL, HeartbeatField, encode_heartbeat, parse_heartbeat
from kairos.common.errors import ConfigError
from kairos.launcher.processes import free_port
from kairos.nodeagent.heartbeat import (
    EngineState,
    EngineStateError,
    HeartbeatPublisher,
    HttpStateSource,
    PublisherConfig,
    SidecarProbe,
    build_heartbeat,
    main,
    state_endpoint,
)
from tests.redis_server import RedisServer
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "kairos.nodeagent.heartbeat"

STATE = EngineState(
    decode_tokens=12,
    kv_tokens=34_000,
    kv_capacity_tokens=100_000,
    queued_prefill_tokens=(2048, 512),
    scheduled_prefill_tokens=(700,),
    max_step_tokens=2048,
    model="tiny-llama",
    tpot_slo_ms=60.0,  # the tightest TPOT among its requests, copied into the beat
)


class FakeSource:
    """An in-process engine: returns ``state``, or raises while ``fail`` is set."""

    def __init__(self, state: EngineState = STATE, delay_s: float = 0.0) -> None:
        self.state = state
        self.fail = False
        self.delay_s = delay_s
        self.reads: list[float] = []  # monotonic time of each read

    async def read(self) -> EngineState:
        self.reads.append(time.monotonic())
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionRefusedError("engine down")
        return self.state


def config(redis: str, **kw: Any) -> PublisherConfig:
    base = {
        "node_id": "d0",
        "role": "decode",
        "url": "127.0.0.1:8101",
        "sidecar": "127.0.0.1:8201",
        "redis_url": redis,
        "period_s": 0.02,
        "ttl_s": 0.1,
        "state_timeout_s": 0.05,
        "redis_timeout_s": 2.0,  # generous: a stopped Redis refuses at once; a busy CI host is slow
    }
    return PublisherConfig(**{**base, **kw})


@pytest.fixture
async def client(redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis.url)
    yield c
    await c.aclose()


async def running(publisher: HeartbeatPublisher) -> asyncio.Task[None]:
    return asyncio.create_task(publisher.run())


async def finish(task: asyncio.Task[None]) -> None:
    """Cancel until done: Python 3.11's wait_for (used inside redis-py) can swallow one cancel."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    assert task.cancelled()


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------
async def test_beat_sets_the_key_with_every_field_and_an_expiry_and_publishes_it(
    redis: RedisServer, client: aioredis.Redis
) -> None:
    cfg = config(redis.url)
    pubsub = client.pubsub()
    await pubsub.subscribe(REDIS_HEARTBEAT_CHANNEL)
    publisher = HeartbeatPublisher(cfg, FakeSource())
    task = await running(publisher)
    try:
        raw = await eventually(lambda: client.get("kairos:node:d0"), what="key kairos:node:d0")
        pttl = await client.pttl("kairos:node:d0")
        first = json.loads(raw)
        assert set(first) == {*HeartbeatField.REQUIRED, HeartbeatField.TPOT_SLO_MS}  # its one optional field set
        assert parse_heartbeat(raw, "d0") == build_heartbeat(cfg, STATE, first["seq"], first["sent_at"])
        assert first["queued_prefill_tokens"] == [2048, 512] and first["scheduled_prefill_tokens"] == [700]
        assert first["tpot_slo_ms"] == 60.0
        assert 0 < pttl <= 100
        assert abs(first["sent_at"] - time.time()) < 1.0

        async def newer() -> dict[str, Any] | None:
            raw = await client.get("kairos:node:d0")  # None while the key lapses on a starved host
            beat = json.loads(raw) if raw else None
            return beat if beat and beat["seq"] > first["seq"] else None

        second = await eventually(newer, what="a later seq")
        assert second["sent_at"] >= first["sent_at"]

        async def on_channel() -> dict[str, Any] | None:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
            return json.loads(msg["data"]) if msg else None

        published = await eventually(on_channel, what="a message on kairos:heartbeats")
        assert set(published) == {*HeartbeatField.REQUIRED, HeartbeatField.TPOT_SLO_MS}
        assert published["node_id"] == "d0" and published["sidecar"] == "127.0.0.1:8201"
        assert publisher.seq >= second["seq"] and publisher.published >= 2
    finally:
        await finish(task)
        await pubsub.aclose()


KV_EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
    '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
)


@pytest.mark.parametrize(
    ("changes", "advertised"),
    [
        pytest.param({}, None, id="no config"),
        pytest.param({"kv_events_config": '{"enable_kv_cache_events": false}'}, None, id="events off"),
        pytest.param(
            {"kv_events_config": KV_EVENTS},
            ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv-events"),
            id="wildcard binds advertised at the url's host",
        ),
        pytest.param(
            {"kv_events_config": KV_EVENTS, "kv_events_host": "10.1.2.3"},
            ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv-events"),
            id="at the host given",
        ),
        pytest.param(
            {"kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "ipc:///run/ev"}'},
            ("ipc:///run/ev", None, ""),
            id="ipc as it is, vLLM's default topic, no replay",
        ),
        pytest.param(
            {"kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://[::]:5557"}', "url": "[::1]:81"},
            ("tcp://[::1]:5557", None, ""),
            id="IPv6",
        ),
    ],
)
def test_the_beat_advertises_the_nodes_kv_event_sockets(
    changes: dict[str, Any], advertised: tuple[str, str | None, str] | None
) -> None:
    cfg = config("redis://127.0.0.1:6379/0", **changes)
    endpoints = cfg.kv_event_endpoints()
    hb = parse_heartbeat(encode_heartbeat(build_heartbeat(cfg, STATE, 1, 0.0, endpoints)), "d0")
    got = (hb.kv_events_endpoint, hb.kv_events_replay_endpoint, hb.kv_events_topic)
    assert got == (advertised or (None, None, None))
    assert HeartbeatPublisher(cfg, FakeSource()).kv_events == endpoints


async def test_a_failing_engine_stops_the_beats_so_the_key_expires_and_they_resume_when_it_recovers(
    redis: RedisServer, client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cfg = config(redis.url)
    source = FakeSource()
    publisher = HeartbeatPublisher(cfg, source)
    task = await running(publisher)
    try:
        await eventually(lambda: client.exists("kairos:node:d0"), what="first beat")
        source.fail = True
        reads = len(source.reads)
        await eventually(lambda: len(source.reads) > reads, what="a failed read")
        published = publisher.published  # a beat in flight when the engine failed counts before this

        async def gone() -> bool:
            return not await client.exists("kairos:node:d0")

        # No beat after a failed read, so the key expires by its TTL (however slow the host).
        await eventually(gone, what="key expiry")
        assert publisher.published == published
        reads = len(source.reads)
        await eventually(lambda: len(source.reads) >= reads + 3, what="three more failed reads")
        assert publisher.published == published  # nothing published while the engine is down
        assert not task.done()
        assert len(messages(caplog, "engine state unavailable for node d0")) == 1  # once per outage

        source.fail = False
        await eventually(lambda: client.exists("kairos:node:d0"), what="beats resume")
        assert len(messages(caplog, "engine state of node d0 readable again")) == 1
        assert len(messages(caplog, "engine state unavailable")) == 1
    finally:
        await finish(task)


class FakeSidecar:
    """A sidecar's HTTP port: answers every request with a 200, or, while :meth:`hang` holds,
    accepts the connection and answers nothing (a stopped or hung process, as a probe meets it)."""

    def __init__(self) -> None:
        self.port = 0
        self.answered = 0
        self._server: asyncio.Server | None = None
        self._released = asyncio.Event()
        self._released.set()

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeSidecar:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def hang(self, hung: bool) -> None:
        if hung:
            self._released.clear()
        else:
            self._released.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):  # the probe gave up first
                await reader.readuntil(b"\r\n\r\n")
                await self._released.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                self.answered += 1
        finally:
            writer.close()


async def test_a_decode_node_whose_sidecar_refuses_connections_stops_beating_until_it_listens_again(
    redis: RedisServer, client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway reaches a decode node only through its sidecar: with the engine fine but the
    sidecar gone, the node must leave the view as if it were dead, and come back with it."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    sidecar = await FakeSidecar().start()
    # A generous probe timeout: on a starved host an in-process answer may take a while, and only
    # the refusal below may count as an outage.
    cfg = config(redis.url, sidecar=sidecar.hostport, state_timeout_s=2.0)
    source = FakeSource()
    publisher = HeartbeatPublisher(cfg, source, SidecarProbe(cfg.sidecar))
    task = await running(publisher)
    try:
        await eventually(lambda: client.exists("kairos:node:d0"), what="first beat")
        await sidecar.stop()
        reads = len(source.reads)
        await eventually(lambda: len(source.reads) > reads + 1, what="a beat after the sidecar closed")
        published = publisher.published

        async def gone() -> bool:
            return not await client.exists("kairos:node:d0")

        await eventually(gone, what="key expiry")
        reads = len(source.reads)
        await eventually(lambda: len(source.reads) >= reads + 3, what="three more beats' reads")
        assert publisher.published == published  # the engine answers, yet nothing is published
        assert len(messages(caplog, f"sidecar of node d0 at {sidecar.hostport} unreachable")) == 1

        await sidecar.start()  # the same port
        await eventually(lambda: client.exists("kairos:node:d0"), what="beats resume")
        assert len(messages(caplog, "sidecar of node d0 answers again")) == 1
    finally:
        await finish(task)
        await sidecar.stop()


async def test_the_sidecar_probe_fails_on_a_port_that_completes_handshakes_but_never_answers() -> None:
    """A stopped (SIGSTOP) or hung sidecar: the kernel completes TCP handshakes on its listening
    port until the backlog fills (over 15 s of probes under ``kairos up``), so a bare connect
    passes and the node stayed fresh while every request sent to it hung."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(64)  # never accepted
        probe = SidecarProbe(f"127.0.0.1:{listening.getsockname()[1]}")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await probe.check()


async def test_a_decode_node_whose_sidecar_stops_answering_stops_beating_within_the_hang_limit(
    redis: RedisServer, client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sidecar = await FakeSidecar().start()
    cfg = config(redis.url, sidecar=sidecar.hostport, state_timeout_s=0.1, sidecar_hang_s=0.3, ttl_s=0.2)
    publisher = HeartbeatPublisher(cfg, FakeSource(), SidecarProbe(cfg.sidecar))
    task = await running(publisher)
    try:
        await eventually(lambda: client.exists("kairos:node:d0"), what="first beat")
        sidecar.hang(True)

        async def gone() -> bool:
            return not await client.exists("kairos:node:d0")

        await eventually(gone, what="key expiry while the sidecar accepts connections but answers none")
        assert messages(caplog, f"sidecar of node d0 at {sidecar.hostport} unreachable: no answer")
        sidecar.hang(False)
        await eventually(lambda: client.exists("kairos:node:d0"), what="beats resume")
        assert messages(caplog, "sidecar of node d0 answers again")
    finally:
        await finish(task)
        await sidecar.stop()


class SlowProbe:
    """A sidecar probe that answers at once, or, while ``slow``, later than any probe timeout."""

    hostport = "127.0.0.1:8201"

    def __init__(self) -> None:
        self.slow = False
        self.checks = 0

    async def check(self) -> None:
        self.checks += 1
        if self.slow:
            await asyncio.Event().wait()


async def test_a_sidecar_slow_to_answer_for_less_than_the_hang_limit_keeps_the_node_beating(
    redis: RedisServer, client: aioredis.Redis
) -> None:
    """A loaded sidecar loop that misses a probe's timeout now and then is not a dead sidecar:
    leaving the view for it would move traffic off a node that serves it."""
    probe = SlowProbe()
    cfg = config(redis.url, state_timeout_s=0.05, sidecar_hang_s=3600.0)
    publisher = HeartbeatPublisher(cfg, FakeSource(), probe)  # type: ignore[arg-type]
    task = await running(publisher)
    try:
        await eventually(lambda: publisher.published > 0, what="first beat")
        probe.slow = True
        checks, published = probe.checks, publisher.published
        await eventually(lambda: probe.checks >= checks + 3, what="three probes timing out")
        await eventually(lambda: publisher.published >= published + 3, what="beats through the slow probes")
    finally:
        await finish(task)


async def test_publisher_rides_out_a_redis_restart_on_the_same_port(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cfg = config(redis.url)  # its generous Redis timeout: a 0.1 s one made an outage of its own on a busy CI
    source = FakeSource()
    publisher = HeartbeatPublisher(cfg, source)
    task = await running(publisher)
    try:
        await eventually(lambda: publisher.published >= 2, what="two beats")
        port = redis.port
        redis.stop()
        reads = len(source.reads)
        await eventually(lambda: len(source.reads) >= reads + 5, what="five beats into the outage")
        assert not task.done()
        outage = messages(caplog, "redis unreachable at redis://127.0.0.1:")
        assert len(outage) == 1 and outage[0].levelno == logging.WARNING
        published = publisher.published

        redis.start()
        assert redis.port == port
        async with aioredis.Redis.from_url(redis.url) as c:
            raw = await eventually(lambda: c.get("kairos:node:d0"), what="key after restart")
        assert json.loads(raw)["seq"] > published
        assert publisher.published > published
        assert len(messages(caplog, "answers again")) == 1
        assert len(messages(caplog, "redis unreachable")) == 1
    finally:
        await finish(task)


async def test_stop_deletes_the_key_but_a_crash_leaves_it_to_expire(redis: RedisServer, client: aioredis.Redis) -> None:
    cfg = config(redis.url)
    publisher = HeartbeatPublisher(cfg, FakeSource())
    task = await running(publisher)
    await eventually(lambda: client.exists("kairos:node:d0"), what="first beat")
    publisher.stop()
    async with asyncio.timeout(1.0):
        await task
    assert await client.exists("kairos:node:d0") == 0
    assert not publisher.running

    crashing = HeartbeatPublisher(replace(cfg, node_id="d1"), FakeSource())
    task = await running(crashing)
    await eventually(lambda: client.exists("kairos:node:d1"), what="first beat of d1")
    await finish(task)  # cancelled: no clean shutdown
    assert 0 < await client.pttl("kairos:node:d1") <= 100  # still there, expiring by itself


async def test_stop_leaves_a_key_that_a_newer_publisher_took_over(redis: RedisServer, client: aioredis.Redis) -> None:
    cfg = config(redis.url)
    publisher = HeartbeatPublisher(cfg, FakeSource())
    task = await running(publisher)
    await eventually(lambda: client.exists("kairos:node:d0"), what="first beat")
    publisher.stop()
    await client.set("kairos:node:d0", "{newer publisher}", px=1000)  # before the loop notices stop()
    async with asyncio.timeout(1.0):
        await task
    assert await client.get("kairos:node:d0") == b"{newer publisher}"


async def test_beats_stay_on_the_period_grid_when_reads_are_slow(redis: RedisServer) -> None:
    """A read that takes half a period must not push every later beat back by that much."""
    cfg = config(redis.url, period_s=0.05)
    source = FakeSource(delay_s=0.025)
    task = await running(HeartbeatPublisher(cfg, source))
    try:
        await eventually(lambda: len(source.reads) >= 21, what="21 reads")
    finally:
        await finish(task)
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(source.reads[:21]))
    # On the grid the typical gap is one period (0.050 s); sleeping a full period after each
    # beat makes it period + read (0.075 s). The median ignores a beat the shared machine delayed.
    assert gaps[len(gaps) // 2] < 0.0625, f"median gap between beats {gaps[len(gaps) // 2]:.3f} s"


async def test_a_hung_engine_counts_as_down(redis: RedisServer, client: aioredis.Redis) -> None:
    cfg = config(redis.url, state_timeout_s=0.03)
    source = FakeSource(delay_s=10.0)  # never answers in time
    publisher = HeartbeatPublisher(cfg, source)
    task = await running(publisher)
    try:
        await eventually(lambda: len(source.reads) >= 3, what="three reads")
        assert publisher.published == 0 and await client.exists("kairos:node:d0") == 0
    finally:
        await finish(task)


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"role": "mixed"}, "role must be one of", id="unknown role"),
        pytest.param({"node_id": ""}, "node_id must be non-empty", id="empty node id"),
        pytest.param({"node_id": "d*"}, "glob characters", id="glob in node id"),
        pytest.param({"sidecar": ""}, "sidecar (host:port) is required", id="decode without sidecar"),
        pytest.param({"role": "prefill"}, "sidecar must be empty", id="prefill with sidecar"),
        pytest.param({"url": "localhost"}, "url: expected host:port", id="url without port"),
        pytest.param({"sidecar": "h:99999"}, "sidecar: expected host:port", id="sidecar port out of range"),
        pytest.param({"redis_url": "http://x:1"}, "redis_url: expected", id="not a redis url"),
        pytest.param({"period_s": 0.0}, "period_s must be > 0", id="zero period"),
        pytest.param({"ttl_s": 0.02}, "ttl_s=0.02 must be > period_s=0.02", id="ttl not above period"),
        pytest.param({"state_timeout_s": 0.0}, "state_timeout_s=0.0", id="zero state timeout"),
        pytest.param({"state_url": "ftp://x:1"}, "state url: expected", id="bad state url"),
        pytest.param({"kv_events_config": "{"}, "--kv-events-config", id="kv events config not JSON"),
        pytest.param(
            {"kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:5557"}'},
            "vLLM connects its publisher to a concrete host",
            id="kv events endpoint vLLM would connect out to",
        ),
        pytest.param(
            {"kv_events_config": '{"enable_kv_cache_events": true}', "kv_events_host": "a host"},
            "not one a subscriber can connect to",
            id="kv events host not advertisable",
        ),
    ],
)
def test_invalid_publisher_configs_are_rejected(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config("redis://127.0.0.1:6379/0", **changes)
    assert message in info.value.message


def test_a_prefill_config_needs_no_sidecar_and_state_url_defaults_to_url() -> None:
    cfg = config("redis://127.0.0.1:6379/0", node_id="p0", role="prefill", url="10.0.0.1:8001", sidecar="")
    assert cfg.key == "kairos:node:p0" and cfg.ttl_ms == 100
    assert cfg.state_endpoint == "http://10.0.0.1:8001/kairos/state"


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("127.0.0.1:8101", "http://127.0.0.1:8101/kairos/state"),
        ("http://127.0.0.1:8101", "http://127.0.0.1:8101/kairos/state"),
        ("http://127.0.0.1:8101/", "http://127.0.0.1:8101/kairos/state"),
        ("https://node:443/custom/state", "https://node:443/custom/state"),
    ],
)
def test_state_endpoint(address: str, endpoint: str) -> None:
    assert state_endpoint(address) == endpoint


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"decode_tokens": -1}, "decode_tokens must be an int >= 0"),
        ({"max_step_tokens": 0}, "max_step_tokens must be an int >= 1"),
        ({"kv_tokens": 1.5}, "kv_tokens must be an int"),
        ({"queued_prefill_tokens": (1, -2)}, "queued_prefill_tokens must be a list of ints >= 0, got (1, -2)"),
        ({"model": 7}, "model must be a string"),
    ],
)
def test_invalid_engine_states_are_rejected(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineStateError) as info:
        msgspec.structs.replace(STATE, **changes)
    assert message in info.value.message


# ---------------------------------------------------------------------------------------------
# HttpStateSource
# ---------------------------------------------------------------------------------------------
STATE_JSON = {
    "decode_tokens": 12,
    "kv_tokens": 34_000,
    "kv_capacity_tokens": 100_000,
    "queued_prefill_tokens": [2048, 512],
    "scheduled_prefill_tokens": [700],
    "max_step_tokens": 2048,
    "model": "tiny-llama",
    "tpot_slo_ms": 60.0,
}


class StateServer:
    """A tiny aiohttp server answering GET /kairos/state with ``body`` and ``status``."""

    def __init__(self) -> None:
        self.body: Any = STATE_JSON
        self.status = 200
        self.delay_s = 0.0
        self.hits = 0
        self.peers: set[Any] = set()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if isinstance(self.body, str):
            return web.Response(status=self.status, text=self.body)
        return web.json_response(self.body, status=self.status)

    async def start(self) -> StateServer:
        app = web.Application()
        app.router.add_get("/kairos/state", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def state_server() -> AsyncIterator[StateServer]:
    server = await StateServer().start()
    yield server
    await server.stop()


async def test_http_state_source_reads_the_engine_state(state_server: StateServer) -> None:
    source = HttpStateSource(f"127.0.0.1:{state_server.port}", timeout_s=5.0)
    try:
        assert await source.read() == STATE
        session = source.session
        state_server.body = {**STATE_JSON, "decode_tokens": 13, "extra_field": "ignored"}
        assert await source.read() == msgspec.structs.replace(STATE, decode_tokens=13)
        assert source.session is session  # one session, reused
        assert state_server.hits == 2 and len(state_server.peers) == 1  # one kept-alive connection
    finally:
        await source.aclose()


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        pytest.param(500, {"error": "boom"}, "HTTP 500", id="server error"),
        pytest.param(200, "not json", "JSONDecodeError", id="not json"),
        pytest.param(200, [1, 2], "expected a JSON object", id="not an object"),
        pytest.param(200, {k: v for k, v in STATE_JSON.items() if k != "kv_tokens"}, "missing fields", id="missing"),
        pytest.param(200, {**STATE_JSON, "queued_prefill_tokens": 5}, "must be a list", id="queue not a list"),
    ],
)
async def test_http_state_source_rejects_bad_answers(
    state_server: StateServer, status: int, body: Any, message: str
) -> None:
    state_server.status, state_server.body = status, body
    source = HttpStateSource(f"127.0.0.1:{state_server.port}", timeout_s=5.0)
    try:
        with pytest.raises(EngineStateError) as info:
            await source.read()
        assert message in info.value.message
    finally:
        await source.aclose()


async def test_http_state_source_times_out_and_reports_a_dead_server(state_server: StateServer) -> None:
    state_server.delay_s = 3.0
    source = HttpStateSource(f"127.0.0.1:{state_server.port}", timeout_s=0.05)
    dead = HttpStateSource(f"127.0.0.1:{free_port()}", timeout_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(EngineStateError, match="TimeoutError"):
            await source.read()
        assert time.monotonic() - started < 2.0  # gave up long before the server would answer
        with pytest.raises(EngineStateError, match="Cannot connect"):
            await dead.read()
    finally:
        await source.aclose()
        await dead.aclose()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
async def test_cli_publishes_until_sigterm_then_exits_cleanly_and_deregisters(
    redis: RedisServer, client: aioredis.Redis, state_server: StateServer
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kairos.nodeagent.heartbeat",
        "--node-id",
        "d7",
        "--role",
        "decode",
        "--url",
        "127.0.0.1:8101",
        "--sidecar",  # the CLI checks that its sidecar answers HTTP: any HTTP server does (this one 404s)
        f"127.0.0.1:{state_server.port}",
        "--redis",
        redis.url,
        "--state-url",
        f"127.0.0.1:{state_server.port}",
        "--period-s",
        "0.02",
        "--ttl-s",
        "0.2",
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # Generous: a Python CLI's start-up on a starved CI host, not the publisher, is what waits here.
        raw = await eventually(lambda: client.get("kairos:node:d7"), timeout_s=60.0, what="CLI heartbeat")
        beat = json.loads(raw)
        assert beat["role"] == "decode" and beat["decode_tokens"] == 12 and beat["model"] == "tiny-llama"
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30.0)
        assert proc.returncode == 0, stderr.decode()
        assert await client.exists("kairos:node:d7") == 0
        assert b"heartbeat stopped, kairos:node:d7 deleted" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_cli_rejects_an_invalid_config(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--node-id", "d0", "--role", "decode", "--url", "127.0.0.1:8101"])
    assert rc == 2
    assert "sidecar (host:port) is required" in capsys.readouterr().err


async def _gone(client: aioredis.Redis, key: str) -> bool:
    return await client.exists(key) == 0


async def test_a_busy_engine_keeps_its_last_beat_alive_for_the_hold_and_a_dead_one_does_not(
    redis: RedisServer, client: aioredis.Redis
) -> None:
    """A state read that times out after good beats is a busy engine (a real CPU vLLM's state
    server went unanswered for 29 s under load, and its only decode node left the view): the key
    lives on with the last beat unchanged, so the node stays, stale. The hold ends after
    busy_hold_s. A refused read is a dead engine: the key expires."""
    cfg = config(redis.url, state_timeout_s=0.05, busy_hold_s=1.5)
    key = "kairos:node:d0"
    source = FakeSource()
    publisher = HeartbeatPublisher(cfg, source)
    task = await running(publisher)
    try:
        await eventually(lambda: publisher.published >= 2, what="two beats")
        source.delay_s = 10.0  # busy: every read times out from now on
        busy_since = time.monotonic()
        last = await eventually(lambda: client.get(key), what="the last beat")
        seq = json.loads(last)["seq"]

        async def held_past_its_ttl() -> bool:
            return time.monotonic() - busy_since > 3 * cfg.ttl_s and await client.get(key) == last

        await eventually(held_past_its_ttl, what="the same beat alive past its TTL")
        assert seq == publisher.seq and publisher.published == seq  # no new beat while busy

        async def gone_after_the_hold() -> bool:
            # A starved host can let the key lapse for a moment between two held beats (CI saw
            # it gone at 1.48 s of a 1.5 s hold): only its absence once the hold is over counts.
            return time.monotonic() - busy_since >= cfg.busy_hold_s and await _gone(client, key)

        await eventually(gone_after_the_hold, timeout_s=30, what="the key expired after the hold")
        assert publisher.published == seq  # and no beat was published after the hold either
    finally:
        await finish(task)

    source = FakeSource()  # a dead engine: refused, good beats before or not
    publisher = HeartbeatPublisher(cfg, source)
    task = await running(publisher)
    try:
        await eventually(lambda: publisher.published >= 2, what="two beats")
        source.fail = True
        await eventually(lambda: _gone(client, key), what="the key expired")
    finally:
        await finish(task)
