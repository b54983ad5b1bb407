"""The dispatcher's prefix caches wired end to end below Envoy: real heartbeat publishers writing
to a real redis-server, a RedisClusterView polling it that keeps a KvEventConsumer subscribed to
the nodes whose beats advertise KV event sockets, a publisher speaking vLLM's wire format on real
ZMQ sockets playing d1's prefix cache, and Dispatcher.route deciding on what it holds.

d1 advertises the test's publisher; p0 and d0 advertise nothing (the count-only nodes). On the
engines below a 6,000-token prompt keeps on an idle cluster (p0, decode d0); cached on d1, it is
deflected to d1 over its uncached tokens (with the deflection gate off: by default an idle
cluster's keep path meets the TTFT SLO with room, and nothing is deflected there). A node
restart (sequence numbers from 0 on the same ports), a lost connection, new sockets in d1's
beats and d1 leaving each take its hits away.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.aio import cancel_and_wait
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.core.prefix_index import PrefixIndex
from kairos.extproc.cluster import ClusterViewConfig, RedisClusterView
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings, RequestHead, Routed
from kairos.extproc.kv_events import KvEventConsumer
from kairos.extproc.membership import MembershipConfig
from kairos.extproc.metrics import DispatcherMetrics, PrefixIndexCollector
from kairos.launcher.local_cluster import kv_events_config
from kairos.launcher.tinymodel import build_tiny_model
from kairos.nodeagent.heartbeat import EngineState, HeartbeatPublisher, PublisherConfig
from tests.kv_publisher import VllmEventPublisher
from tests.redis_server import RedisServer
from tests.waiting import eventually

PROMPT = [3 + (i * 7) % 1000 for i in range(6000)]
CACHED = 5984  # 374 blocks of 16
OTHER = [5 + (i * 11) % 1000 for i in range(800)]
ENGINES = {
    "p0": ("prefill", "127.0.0.1:8001", "", EngineState(0, 0, 100_000, (), (), 2048, "tiny")),
    "d0": ("decode", "127.0.0.1:8101", "127.0.0.1:8201", EngineState(8, 1000, 100_000, (), (), 4096, "tiny")),
    "d1": ("decode", "127.0.0.1:8102", "127.0.0.1:8202", EngineState(16, 5000, 100_000, (), (), 4096, "tiny")),
}


class Source:
    def __init__(self, state: EngineState) -> None:
        self.state = state

    async def read(self) -> EngineState:
        return self.state


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("prefix-routing-model"))
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture
def kv() -> Iterator[list[VllmEventPublisher]]:
    """d1's publishers, closed at the end (a test may start several: restarts, new sockets)."""
    started: list[VllmEventPublisher] = []
    yield started
    for pub in started:
        pub.close()


@dataclass
class Gateway:
    redis: RedisServer
    consumer: KvEventConsumer
    view: RedisClusterView
    dispatcher: Dispatcher
    metrics: DispatcherMetrics
    beats: dict[str, asyncio.Task[None]]
    publishers: dict[str, HeartbeatPublisher]

    def beat(self, node_id: str, kv_events: VllmEventPublisher | None = None) -> None:
        """Start ``node_id``'s heartbeat publisher, advertising ``kv_events``'s sockets."""
        role, url, sidecar, state = ENGINES[node_id]
        config = "" if kv_events is None else kv_events_config(*kv_events.ports).to_json()
        cfg = PublisherConfig(
            node_id,
            role,
            url,
            sidecar,
            self.redis.url,
            period_s=0.02,
            ttl_s=0.2,
            redis_timeout_s=2.0,
            kv_events_config=config,
        )
        publisher = self.publishers[node_id] = HeartbeatPublisher(cfg, Source(state))
        self.beats[node_id] = asyncio.create_task(publisher.run())

    async def stop_beating(self, node_id: str) -> None:
        """A clean stop: the key is deleted, the node leaves at the next poll."""
        self.publishers[node_id].stop()
        await asyncio.wait_for(self.beats.pop(node_id), 30)

    async def route(self, prompt: list[int] = PROMPT) -> dict[str, str]:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8}).encode()
        routed = await self.dispatcher.route(RequestHead.of("POST", "/v1/completions", {}), body)
        assert isinstance(routed, Routed), routed
        return dict(routed.set_headers)

    def d1_hit(self) -> int:
        return self.consumer.hits(PROMPT).get("d1", 0)

    def d1_ready(self) -> bool:
        sub = self.consumer.subscribers.get("d1")
        return sub is not None and sub.connected and self.consumer.index.stats("d1").synced


@pytest.fixture
async def gateway(redis: RedisServer, tokenizer: PromptTokenizer) -> AsyncIterator[Gateway]:
    clock = time.monotonic
    consumer = KvEventConsumer(PrefixIndex(stale_after_s=1.0), clock, replay_timeout_s=5.0)
    config = ClusterViewConfig(
        redis_url=redis.url, poll_s=0.02, redis_timeout_s=2.0, membership=MembershipConfig(stale_after_s=1.0)
    )
    registry = CollectorRegistry()
    registry.register(PrefixIndexCollector(consumer))
    view = RedisClusterView(config, clock=clock, registry=registry, kv_events=consumer)
    models = load_profile()
    metrics = DispatcherMetrics(registry)
    dispatcher = Dispatcher(
        tokenizer,
        create_policy("kairos:gate=off", models),
        create_policy("pd", models),
        view,
        metrics,
        DispatchSettings(),
        prefixes=consumer,
    )
    gw = Gateway(redis, consumer, view, dispatcher, metrics, {}, {})
    await view.start()
    yield gw
    for task in gw.beats.values():
        await cancel_and_wait(task)
    await view.stop()
    await consumer.close()
    dispatcher.close()


async def stored(pub: VllmEventPublisher, tokens: list[int], indexed: Callable[[], bool]) -> None:
    """Publish the blocks of ``tokens`` until ``indexed()``: a batch sent while a subscription is
    still on its way to the PUB socket is dropped there (ZMQ's slow joiner) and, with no batch
    after it, no gap tells the subscriber; storing the same blocks again changes nothing else."""

    def again() -> bool:
        if indexed():
            return True
        pub.store(tokens)
        return False

    pub.store(tokens)
    await eventually(again, what="the blocks indexed", interval_s=0.1)


async def started(gw: Gateway, kv: list[VllmEventPublisher], pub: VllmEventPublisher) -> VllmEventPublisher:
    kv.append(pub)
    for node_id in ("p0", "d0"):
        gw.beat(node_id)
    gw.beat("d1", pub)
    await eventually(lambda: len(gw.view.view().decode) == 2 and gw.view.view().prefill, what="the cluster in view")
    await eventually(gw.d1_ready, what="d1's events subscribed and in step")
    assert set(gw.consumer.subscribers) == {"d1"}  # p0 and d0 advertise nothing
    return pub


async def test_a_prompt_cached_on_d1_is_deflected_there_and_a_restart_takes_the_hit_away(
    gateway: Gateway, kv: list[VllmEventPublisher]
) -> None:
    gw = gateway
    pub = await started(gw, kv, VllmEventPublisher())
    headers = await gw.route()
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE]) == ("keep", "d0")  # nothing cached yet

    await stored(pub, PROMPT[:CACHED], lambda: gw.d1_hit() == CACHED)
    headers = await gw.route()
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE], headers[c.H_CACHED_TOKENS]) == ("deflect", "d1", "5984")
    assert sum(int(x) for x in headers[c.H_CHUNK_SCHEDULE].split(",")) == len(PROMPT) - CACHED
    (d1,) = [n for n in gw.view.nodes_report()["nodes"] if n["id"] == "d1"]
    assert d1["kv_events"]["cached_blocks"] == CACHED // 16 and d1["kv_events"]["fresh"]
    sample = gw.metrics.registry.get_sample_value
    assert sample("kairos_dispatcher_kv_events_up", {"node": "d1"}) == 1.0
    assert sample("kairos_dispatcher_prefix_index_blocks", {"node": "d1"}) == CACHED // 16
    assert sample("kairos_dispatcher_prefix_hit_tokens_total", {"route": "deflect", "role": "decode"}) == CACHED

    # The engine restarts on the same ports: a new process, sequence numbers from 0, its cache
    # empty. Whether the subscriber sees the connection drop or only the sequence start over,
    # d1's index is cleared; the prompt keeps again.
    pub.close()
    restarted = VllmEventPublisher(*(f"tcp://127.0.0.1:{port}" for port in pub.ports))
    kv.append(restarted)
    await stored(restarted, OTHER, lambda: gw.consumer.hits(OTHER).get("d1", 0) == 784)
    assert gw.d1_hit() == 0
    assert (await gw.route())[c.H_ROUTE] == "keep"
    assert gw.metrics.registry.get_sample_value("kairos_dispatcher_kv_events_resets_total", {"node": "d1"}) >= 1


async def test_a_disconnected_node_reads_zero_hits(gateway: Gateway, kv: list[VllmEventPublisher]) -> None:
    gw = gateway
    pub = await started(gw, kv, VllmEventPublisher())
    await stored(pub, PROMPT[:CACHED], lambda: gw.d1_hit() == CACHED)
    pub.close()  # the engine is gone; its heartbeat still beats (a hung engine, a cut link)
    await eventually(lambda: gw.d1_hit() == 0, what="d1's hits gone with its connection")
    assert not gw.consumer.subscribers["d1"].connected
    assert (await gw.route())[c.H_ROUTE] == "keep"


async def test_new_sockets_in_the_beats_resubscribe_and_a_node_that_leaves_is_dropped(
    gateway: Gateway, kv: list[VllmEventPublisher]
) -> None:
    gw = gateway
    first = await started(gw, kv, VllmEventPublisher())
    await stored(first, PROMPT[:CACHED], lambda: gw.d1_hit() == CACHED)

    # d1's engine comes back on other ports and its publisher advertises them
    second = VllmEventPublisher()
    kv.append(second)
    await gw.stop_beating("d1")
    gw.beat("d1", second)
    await eventually(
        lambda: "d1" in gw.consumer.subscribers and gw.consumer.subscribers["d1"].endpoints == second.endpoints,
        what="d1 resubscribed",
    )
    await eventually(gw.d1_ready, what="d1's new sockets in step")
    assert gw.d1_hit() == 0  # the old stream's blocks were dropped with it
    await stored(second, PROMPT, lambda: gw.d1_hit() == CACHED)

    await gw.stop_beating("d1")
    await eventually(lambda: "d1" not in gw.consumer.subscribers, what="d1 unsubscribed")
    assert "d1" not in gw.consumer.index.nodes()
    assert gw.consumer.hits(PROMPT) == {}
