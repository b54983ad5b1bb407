"""Redis as ``kairos up`` starts it: ACL users and TLS on a real redis-server, with the real
publisher, sidecar feedback writer and dispatcher cluster view as its clients (issue 11, part 3).

A node's credential writes its own heartbeat key and the feedback stream, nothing else; the
dispatcher's reads every heartbeat and the stream over ``rediss://`` and takes reservations; a
client without a credential, or without TLS, gets nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import NoPermissionError

import redis
from kairos.common import contracts as c
from kairos.common.redis_acl import ADMIN_USER, DISPATCHER_USER, node_user
from kairos.core.view import ClusterTracker
from kairos.extproc.cluster import ClusterViewConfig, RedisClusterView
from kairos.extproc.feedback import TtftFeedback
from kairos.extproc.membership import MembershipConfig
from kairos.extproc.metrics import DispatcherMetrics
from kairos.extproc.reservations import PROMISE_SCRIPT, REFUSED, HeardPromise, ReservationClient, decode_promise_message
from kairos.nodeagent.heartbeat import HeartbeatPublisher, PublisherConfig, _delete_if_holding
from kairos.nodeagent.sidecar import SidecarMetrics, TtftFeedbackPublisher
from tests.builders import heartbeat_json
from tests.component.test_heartbeat import STATE, FakeSource
from tests.redis_server import SecuredRedisServer
from tests.waiting import eventually, wait_until

P0_URL, D0_URL, D0_SIDECAR = "127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8202"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedisServer]:
    with SecuredRedisServer(tmp_path_factory.mktemp("redis-tls"), ["p0", "d0"], tls=True) as s:
        yield s


@pytest.fixture
async def admin(server: SecuredRedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.setup.admin_url)
    yield client
    await client.aclose()


def sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def publisher(server: SecuredRedisServer, node_id: str, role: str, url: str, sidecar: str = "") -> HeartbeatPublisher:
    cfg = PublisherConfig(
        node_id=node_id,
        role=role,
        url=url,
        sidecar=sidecar,
        redis_url=server.setup.node_url(node_id),
        period_s=0.02,
        ttl_s=0.5,
        redis_timeout_s=2.0,
    )
    return HeartbeatPublisher(cfg, FakeSource(STATE))


def test_the_set_up_keeps_its_secrets_in_private_files(server: SecuredRedisServer) -> None:
    folder = server.setup.folder
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for path in [p for p in folder.rglob("*") if p.is_file() and p.name != "redis.log"]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    acl = (folder / "users.acl").read_text()
    assert all(password not in acl for password in server.setup.passwords.values())  # hashed only
    assert server.setup.server_argv("redis-server") == ["redis-server", str(server.setup.conf_path)]
    assert server.setup.node_url("p0").startswith(f"rediss://{node_user('p0')}:")


def test_no_credential_or_no_tls_gets_nothing(server: SecuredRedisServer) -> None:
    port = server.port
    with pytest.raises(redis.AuthenticationError):  # TLS, no user: the default user is off
        sync(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={server.setup.ca_path}").ping()
    with pytest.raises(redis.AuthenticationError):
        sync(f"rediss://{ADMIN_USER}:guess@127.0.0.1:{port}/0?ssl_ca_certs={server.setup.ca_path}").ping()
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):  # a plain connection to the TLS port
        sync(server.setup.admin_url.replace("rediss://", "redis://").split("?")[0]).ping()
    with pytest.raises(redis.ConnectionError):  # TLS without trusting the cluster's CA
        sync(server.setup.admin_url.split("?")[0]).ping()


def subscribed(client: redis.Redis, channel: str) -> object:
    """SUBSCRIBE and read its answer (redis-py sends it without waiting for one)."""
    pubsub = client.pubsub()
    pubsub.subscribe(channel)
    try:
        return pubsub.get_message(timeout=5.0)
    finally:
        pubsub.close()


def test_a_node_credential_writes_its_own_key_and_the_stream_only(server: SecuredRedisServer) -> None:
    p0 = sync(server.setup.node_url("p0"))
    p0.set(c.REDIS_NODE_KEY.format(node_id="p0"), heartbeat_json("p0"), px=500)
    p0.xadd(c.REDIS_TTFT_FEEDBACK_STREAM, {"probe": "1"})
    p0.publish(c.REDIS_HEARTBEAT_CHANNEL, "x")
    refused = {
        "another node's key": lambda: p0.set(c.REDIS_NODE_KEY.format(node_id="d0"), heartbeat_json("d0")),
        "a new node's key": lambda: p0.set(c.REDIS_NODE_KEY.format(node_id="evil"), heartbeat_json("evil")),
        "deleting another node's key": lambda: p0.delete(c.REDIS_NODE_KEY.format(node_id="d0")),
        "a reservation": lambda: p0.set(c.REDIS_RESERVATION_KEY.format(node_id="d0"), "p0", nx=True, px=300),
        "a promise on the dispatchers' channel": lambda: p0.publish(c.REDIS_PROMISE_CHANNEL, "x"),
        "hearing the dispatchers' promises": lambda: subscribed(p0, c.REDIS_PROMISE_CHANNEL),
        "overwriting the stream": lambda: p0.set(c.REDIS_TTFT_FEEDBACK_STREAM, "junk"),
        "deleting the stream": lambda: p0.delete(c.REDIS_TTFT_FEEDBACK_STREAM),
        "reading the stream": lambda: p0.xrevrange(c.REDIS_TTFT_FEEDBACK_STREAM, count=1),
        "listing keys": lambda: p0.keys("*"),
        "a script on another key": lambda: p0.eval("return redis.call('DEL', KEYS[1])", 1, "kairos:node:d0"),
        "a script that loops on its own key": lambda: p0.eval("while true do end", 1, "kairos:node:p0"),
        "flushing": lambda: p0.flushall(),
        "changing users": lambda: p0.acl_setuser(node_user("p0"), enabled=True, keys=["*"]),
    }
    for what, attempt in refused.items():
        with pytest.raises(NoPermissionError, match="no permissions"):
            attempt()
            pytest.fail(f"a node credential could do this: {what}")


async def test_a_node_credential_deletes_its_key_on_shutdown_only_while_it_holds_its_beat(
    server: SecuredRedisServer,
) -> None:
    """The publisher's compare-and-delete runs as a transaction under the node's own user (no
    script rights): its beat still there is deleted, a newer one (another publisher's) is kept."""
    key = c.REDIS_NODE_KEY.format(node_id="p0")
    client = aioredis.Redis.from_url(server.setup.node_url("p0"), socket_timeout=10)
    try:
        await client.set(key, "newer beat", px=5_000)
        assert not await _delete_if_holding(client, key, "my beat")
        assert await client.get(key) == b"newer beat"
        await client.set(key, "my beat", px=5_000)
        assert await _delete_if_holding(client, key, "my beat")
        assert await client.get(key) is None
    finally:
        await client.aclose()


def test_the_dispatcher_credential_reads_and_reserves_but_writes_no_heartbeat(server: SecuredRedisServer) -> None:
    dispatcher = sync(server.setup.dispatcher_url)
    promise = dispatcher.register_script(PROMISE_SCRIPT)
    # owner, id, tokens, known, since_ms, ttl_ms, channel, node id
    args = ["dispatcher0", 1, 10, 0, 300, 300, c.REDIS_PROMISE_CHANNEL, "d9"]
    hear = dispatcher.pubsub(ignore_subscribe_messages=True)
    hear.subscribe(c.REDIS_PROMISE_CHANNEL)
    assert promise(keys=[c.REDIS_RESERVATION_KEY.format(node_id="d9")], args=args)[0] == 1  # granted
    heard = wait_until(lambda: hear.get_message(timeout=0.5), what="the granted promise on the channel")
    assert decode_promise_message(heard["data"]) == HeardPromise("d9", "dispatcher0", 10, "dispatcher0|1|10")
    hear.close()
    with pytest.raises(NoPermissionError):  # its scripts run with its rights: no heartbeat key
        promise(keys=[c.REDIS_NODE_KEY.format(node_id="p0")], args=args)
    dispatcher.mget([c.REDIS_NODE_KEY.format(node_id="p0")])
    with pytest.raises(NoPermissionError):
        dispatcher.set(c.REDIS_NODE_KEY.format(node_id="p0"), heartbeat_json("p0"))
    with pytest.raises(NoPermissionError):
        dispatcher.xadd(c.REDIS_TTFT_FEEDBACK_STREAM, {"probe": "1"})
    assert DISPATCHER_USER in server.setup.passwords


async def test_a_dispatcher_credential_without_the_promise_channel_refuses_promises_and_says_why(
    server: SecuredRedisServer, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL file written for a version before the promise channel: the script cannot publish,
    so no promise is granted (never a deflection on a guess) and the log names the ACL."""
    caplog.set_level(logging.WARNING, logger="kairos.extproc")
    await admin.execute_command("ACL", "SETUSER", DISPATCHER_USER, "-publish")
    client = aioredis.Redis.from_url(server.setup.dispatcher_url)
    errors: list[None] = []
    promises = ReservationClient(300, lambda: errors.append(None), "secured")
    try:
        refused = await promises.try_reserve(client, "d9", "dispatcher0", 10, known_tokens=0, since_s=0.3)
        again = await promises.try_reserve(client, "d9", "dispatcher0", 10, known_tokens=0, since_s=0.3)
    finally:
        await client.aclose()
        await admin.execute_command("ACL", "SETUSER", DISPATCHER_USER, "+publish")  # the server is the module's
    assert refused == again == REFUSED and len(errors) == 2
    logged = [r.getMessage() for r in caplog.records if "refuses the promise script" in r.getMessage()]
    assert len(logged) == 1 and "ACL" in logged[0]  # once per outage


async def test_publishers_sidecar_and_dispatcher_over_rediss_with_their_own_users(
    server: SecuredRedisServer, admin: aioredis.Redis
) -> None:
    """The real clients, end to end over TLS: two publishers beat, the dispatcher's view adopts
    them (only the listed nodes, at their addresses), takes a reservation, and reads the feedback
    that d0's sidecar writer sends with d0's credential."""
    pubs = [publisher(server, "p0", "prefill", P0_URL), publisher(server, "d0", "decode", D0_URL, D0_SIDECAR)]
    tasks = [asyncio.create_task(p.run()) for p in pubs]
    metrics = DispatcherMetrics(CollectorRegistry())
    view = RedisClusterView(
        ClusterViewConfig(
            redis_url=server.setup.dispatcher_url,
            redis_timeout_s=2.0,
            # Promises live 5 s, and every one is younger than d0's heartbeat age plus a 5 s grace:
            # dispatcher0's promise is counted against dispatcher1's however the two calls fall
            # between heartbeats on a starved host.
            reservation_ttl_s=5.0,
            membership=MembershipConfig(
                fallback_prefill=(f"p0={P0_URL}",), fallback_decode=(f"d0={D0_URL}+{D0_SIDECAR}",), admit_nodes="listed"
            ),
        ),
        ClusterTracker(dispatch_grace_s=5.0),
        registry=metrics.registry,
        feedback=TtftFeedback(metrics, window=10),
    )
    sidecar_metrics = SidecarMetrics()
    writer = TtftFeedbackPublisher(server.setup.node_url("d0"), sidecar_metrics, timeout_s=2.0)
    try:
        async with view:
            await view.wait_ready(timeout=30)

            async def beating() -> bool:  # before the first beats the view holds the static lists, degraded
                return sorted(view.addresses()) == ["d0", "p0"] and not view.degraded

            await eventually(beating, timeout_s=30, what="both publishers' beats in the view, over rediss")
            assert (await view.try_reserve("d0", "dispatcher0", 10)).granted
            refused = await view.try_reserve("d0", "dispatcher1", 10)  # had not counted dispatcher0's
            assert not refused.granted and [p.tokens for p in refused.foreign] == [10]
            await writer.start()
            writer.offer("r1", "keep", "d0", predicted_s=0.1, observed_s=0.2)
            feedback = view.feedback
            assert feedback is not None

            async def sample_read() -> bool:
                return feedback.samples == 1

            await eventually(sample_read, timeout_s=30, what="the dispatcher reading d0's feedback sample")
            assert sidecar_metrics.registry.get_sample_value("kairos_sidecar_ttft_feedback_total", {"outcome": "sent"})
            assert metrics.registry.get_sample_value("kairos_dispatcher_redis_errors_total", {"operation": "poll"}) == 0
    finally:
        await writer.stop()
        for p in pubs:
            p.stop()
        await asyncio.gather(*tasks)
    assert all(p.published > 0 for p in pubs)
    # each publisher deleted its own key on stop (its compare-and-delete script, under its own user)
    assert await admin.exists(c.REDIS_NODE_KEY.format(node_id="p0"), c.REDIS_NODE_KEY.format(node_id="d0")) == 0
