"""The request path with the nodes' prefix caches: Dispatcher.route parses the prompt to its token
ids, looks each node's cached prefix up in the KV event index (a real KvEventConsumer's
PrefixIndex, fed the events directly) and decides on the uncached tokens; the count-only path
where no node is indexed, where the policy is cache-blind, or where a node's index is stale.

The cluster is test_dispatcher's fake (p0 and p1 idle, d0 with B=8 and d1 with B=16): on it a
6,000-token prompt keeps (p0, decode d0), see test_dispatcher's module docstring. Kairos runs with
its deflection gate off (``KAIROS``): on this idle cluster the gate keeps every request, and the
tests are about the hits (test_the_gate_keeps_a_cached_prompt_on_an_idle_cluster says what it does).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.block_hash import block_keys
from kairos.common.kv_events import BlockStored
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.policies import create_policy
from kairos.core.prefix_index import PrefixIndex
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings, PrefixSource, RequestHead, Routed
from kairos.extproc.kv_events import KvEventConsumer
from kairos.extproc.metrics import DispatcherMetrics
from kairos.launcher.tinymodel import build_tiny_model
from tests.unit.test_dispatcher import NOW, OWNER, FakeCluster, make_cluster

BS = 16
KAIROS = "kairos:gate=off"
PROMPT = [3 + (i * 7) % 1000 for i in range(6000)]  # token ids in the tiny model's vocabulary
CACHED = 5984  # the leading 374 blocks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("dispatcher-prefix-model"))
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def models() -> LatencyModels:
    return load_profile()


@pytest.fixture
async def consumer() -> AsyncIterator[KvEventConsumer]:
    c = KvEventConsumer(PrefixIndex(stale_after_s=1.0), clock=lambda: NOW)
    yield c
    await c.close()


def store(index: PrefixIndex, node_id: str, tokens: Sequence[int], seen_at: float = NOW) -> None:
    """``node_id`` holds the full blocks of ``tokens``, as its BlockStored events say."""
    index.add_node(node_id, seen_at)
    keys = block_keys(tokens, BS)
    event = BlockStored(tuple(keys), None, tuple(tokens[: len(keys) * BS]), BS, None, "GPU", None)
    index.apply(node_id, [event], seen_at)


def body(prompt: Sequence[int] = PROMPT) -> bytes:
    return json.dumps({"model": "tiny", "prompt": list(prompt), "max_tokens": 8}).encode()


Metrics = DispatcherMetrics
Build = Callable[..., tuple[Dispatcher, FakeCluster, Metrics]]


@pytest.fixture
def build(tokenizer: PromptTokenizer, models: LatencyModels) -> Iterator[Build]:
    built: list[Dispatcher] = []

    def make(prefixes: PrefixSource | None, policy: str = KAIROS) -> tuple[Dispatcher, FakeCluster, Metrics]:
        cluster, metrics = make_cluster(), DispatcherMetrics(CollectorRegistry())
        dispatcher = Dispatcher(
            tokenizer,
            create_policy(policy, models),
            create_policy("pd", models),
            cluster,
            metrics,
            DispatchSettings(dispatcher_id=OWNER),
            prefixes=prefixes,
        )
        built.append(dispatcher)
        return dispatcher, cluster, metrics

    yield make
    for dispatcher in built:
        dispatcher.close()


async def route(dispatcher: Dispatcher, prompt: Sequence[int] = PROMPT) -> dict[str, str]:
    routed = await dispatcher.route(RequestHead.of("POST", "/v1/completions", {}), body(prompt))
    assert isinstance(routed, Routed), routed
    return dict(routed.set_headers)


def hit_tokens(metrics: DispatcherMetrics, route: str, role: str) -> float:
    labels = {"route": route, "role": role}
    return metrics.registry.get_sample_value("kairos_dispatcher_prefix_hit_tokens_total", labels) or 0.0


def looked_up_tokens(metrics: DispatcherMetrics, route: str) -> float:
    labels = {"route": route}
    return metrics.registry.get_sample_value("kairos_dispatcher_prefix_lookup_prompt_tokens_total", labels) or 0.0


class Spy:
    """A PrefixSource that records its lookups."""

    def __init__(self, inner: PrefixSource, indexing: bool = True) -> None:
        self.inner, self._indexing, self.lookups = inner, indexing, 0

    def indexing(self) -> bool:
        return self._indexing

    def hits(self, token_ids: list[int]) -> Mapping[str, int]:
        self.lookups += 1
        return self.inner.hits(token_ids)


async def test_without_events_the_long_prompt_keeps(build: Build, consumer: KvEventConsumer) -> None:
    dispatcher, _, metrics = build(consumer)
    headers = await route(dispatcher)
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE]) == ("keep", "d0")
    assert c.H_CACHED_TOKENS not in headers
    assert looked_up_tokens(metrics, "keep") == 0  # no node indexed: no lookup


async def test_a_prompt_cached_on_d1_is_deflected_there_over_its_uncached_tokens(
    build: Build, consumer: KvEventConsumer
) -> None:
    store(consumer.index, "d1", PROMPT[:CACHED])
    dispatcher, cluster, metrics = build(consumer)
    headers = await route(dispatcher)
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE]) == ("deflect", "d1")
    assert headers[c.H_CACHED_TOKENS] == str(CACHED)
    assert sum(int(x) for x in headers[c.H_CHUNK_SCHEDULE].split(",")) == len(PROMPT) - CACHED
    decision, _ = cluster.recorded[-1]
    assert decision.cached_tokens == CACHED
    assert hit_tokens(metrics, "deflect", "decode") == CACHED
    assert looked_up_tokens(metrics, "deflect") == len(PROMPT)


async def test_the_gate_keeps_a_cached_prompt_on_an_idle_cluster(build: Build, consumer: KvEventConsumer) -> None:
    """By default (the deflection gate on) the idle cluster's keep path meets the TTFT SLO with room:
    the prompt cached on d1 keeps, and decodes on d1, which holds it."""
    store(consumer.index, "d1", PROMPT[:CACHED])
    dispatcher, _, _ = build(consumer, "kairos")
    headers = await route(dispatcher)
    assert (headers[c.H_ROUTE], headers[c.H_REASON], headers[c.H_DECODE_NODE]) == ("keep", "keep_slo_room", "d1")


async def test_the_keep_path_picks_the_prefill_and_decode_nodes_holding_the_prompt(
    build: Build, consumer: KvEventConsumer
) -> None:
    """P/D never deflects; prefix-aware it prefills on p1, which holds most of the prompt, and
    decodes on d1, which holds all of it (the lighter d0 would pull every block)."""
    store(consumer.index, "p1", PROMPT[:4000])
    store(consumer.index, "d1", PROMPT)
    dispatcher, cluster, metrics = build(consumer, "pd")
    routed = await dispatcher.route(RequestHead.of("POST", "/v1/completions", {}), body())
    assert isinstance(routed, Routed)
    headers = dict(routed.set_headers)
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE], headers[c.H_PREFILL_HOST]) == (
        "keep",
        "d1",
        cluster.nodes["p1"].url,
    )
    assert headers[c.H_CACHED_TOKENS] == "4000"
    assert hit_tokens(metrics, "keep", "prefill") == 4000
    assert hit_tokens(metrics, "keep", "decode") == CACHED  # all but the last token, in full blocks


@pytest.mark.parametrize("policy", ["kairos:prefix=off", "pd:prefix=off", "llmd"])
async def test_a_cache_blind_policy_never_computes_token_ids_or_looks_up(
    build: Build, consumer: KvEventConsumer, policy: str
) -> None:
    store(consumer.index, "d1", PROMPT[:CACHED])
    spy = Spy(consumer)
    dispatcher, _, _ = build(spy, policy)
    headers = await route(dispatcher)
    assert spy.lookups == 0
    assert c.H_CACHED_TOKENS not in headers
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE]) == ("keep", "d0")  # as with no events


async def test_no_indexed_node_keeps_the_count_only_path(build: Build, consumer: KvEventConsumer) -> None:
    spy = Spy(consumer, indexing=False)
    dispatcher, _, _ = build(spy)
    assert (await route(dispatcher))[c.H_ROUTE] == "keep"
    assert spy.lookups == 0


async def test_a_stale_index_reads_zero_hits(build: Build, consumer: KvEventConsumer) -> None:
    """d1's blocks were last confirmed 5 s ago, its event connection is down: as a stale
    heartbeat, it counts for nothing, and the decision is the cache-blind one."""
    store(consumer.index, "d1", PROMPT[:CACHED], seen_at=NOW - 5.0)
    spy = Spy(consumer)
    dispatcher, _, _ = build(spy)
    headers = await route(dispatcher)
    assert spy.lookups == 1
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE]) == ("keep", "d0")
    assert c.H_CACHED_TOKENS not in headers


async def test_an_out_of_step_index_reads_zero_hits(build: Build, consumer: KvEventConsumer) -> None:
    store(consumer.index, "d1", PROMPT[:CACHED])
    consumer.index.set_synced("d1", False)  # a gap being repaired
    dispatcher, _, _ = build(consumer)
    assert (await route(dispatcher))[c.H_ROUTE] == "keep"
