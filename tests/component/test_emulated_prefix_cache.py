"""The emulated vLLM node with prefix caching, on real sockets: its hits as vLLM reports them
(``usage.prompt_tokens_details``, ``vllm:prompt_tokens_by_source``), its KV events read by the
dispatcher's own subscriber into the gateway's prefix index (live, and by replay after a missed
batch), a P/D pull of only the blocks the decode node lacks, and caching off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kairos.common.config import flag_values
from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import (
    BlockStored,
    KvEventEndpoints,
    KvEventsConfig,
    decode_batch,
    decode_replay_reply,
    encode_replay_request,
)
from kairos.core.prefix_index import PrefixIndex, prompt_prefix_hits
from kairos.extproc.kv_events import KvEventConsumer
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.emulated_vllm import SOURCE, EmulatedNodeConfig, build_parser, main
from tests.component.test_emulated_vllm import MODEL, Node, metrics, post, running, sample
from tests.waiting import eventually

BS = 16
TOPIC = "kv-events"
EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": TOPIC}
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel-prefix")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
async def consumer() -> AsyncIterator[KvEventConsumer]:
    c = KvEventConsumer(PrefixIndex(stale_after_s=30.0), replay_timeout_s=10.0)
    yield c
    await c.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    """A prompt of exactly ``n`` token ids."""
    return [100 + (seed * 7919 + i * 31) % 3000 for i in range(n)]


async def complete(http: aiohttp.ClientSession, node: Node, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, **extra}
    status, body = await post(http, f"{node.url}/v1/completions", body)
    assert status == 200, body
    return body


def endpoints(node: Node) -> KvEventEndpoints:
    pub = node.node.kv_events
    assert pub is not None and pub.pub_endpoint is not None
    return KvEventEndpoints(pub.pub_endpoint, pub.replay_endpoint, TOPIC)


async def subscribe(consumer: KvEventConsumer, node: Node) -> None:
    await consumer.set_nodes({"d0": endpoints(node)})
    sub = consumer.subscribers["d0"]
    await eventually(lambda: sub.connected and consumer.index.stats("d0").synced, what="subscribed and in step")


async def test_a_repeated_prompt_reports_its_cached_full_blocks(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with running(model_dir, "d0", Role.DECODE, enable_prompt_tokens_details=True) as node:
        a = prompt(100)
        first = await complete(http, node, a)
        assert first["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
        second = await complete(http, node, a)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks of 99 tokens
        # A prompt sharing 50 tokens hits the 3 blocks they fill; a stream reports what vLLM's does.
        b = a[:50] + prompt(60, seed=1)
        status, raw = await _stream(http, node, b)
        assert status == 200
        usage = json.loads(raw.split(b"data: ")[-2])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 48}
        m = await metrics(http, node.url)
        assert sample(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 96 + 48
        assert sample(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 100 + 4 + 62
        assert sample(m, "vllm:prompt_tokens_total") == 310
        # The chat endpoint reports the tokens a request wrote to the cache too.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 1}
        details = []
        for _ in range(2):
            status, reply = await post(http, f"{node.url}/v1/chat/completions", body)
            assert status == 200, reply
            details.append(reply["usage"]["prompt_tokens_details"])
        n = reply["usage"]["prompt_tokens"]
        full = n // BS * BS
        hit = (n - 1) // BS * BS
        assert details == [
            {"cached_tokens": 0, "created_cache_tokens": full, "multimodal_tokens": None},
            {"cached_tokens": hit, "created_cache_tokens": full - hit, "multimodal_tokens": None},
        ]


async def test_the_next_turn_hits_the_previous_answers_blocks(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with running(model_dir, "d0", Role.DECODE, enable_prompt_tokens_details=True) as node:
        turn1 = prompt(90, seed=8)
        answer = (await complete(http, node, turn1, max_tokens=40))["choices"][0]["text"]
        status, tokenized = await post(http, f"{node.url}/tokenize", {"prompt": answer, "add_special_tokens": False})
        assert status == 200 and tokenized["count"] == 40  # one token per streamed word
        turn2 = turn1 + tokenized["tokens"] + prompt(30, seed=9)
        # vLLM caches the output's full blocks too: 90 + 40 tokens computed (the last one's KV
        # never) fill 8 blocks, 3 more than the prompt alone.
        reply = await complete(http, node, turn2)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS


async def _stream(http: aiohttp.ClientSession, node: Node, ids: list[int]) -> tuple[int, bytes]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{node.url}/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def test_the_nodes_events_give_the_dispatcher_the_hit_the_node_reports(
    model_dir: Path, http: aiohttp.ClientSession, consumer: KvEventConsumer
) -> None:
    overrides = {"enable_prompt_tokens_details": True, "kv_events_config": EVENTS}
    async with running(model_dir, "d0", Role.DECODE, **overrides) as node:
        await subscribe(consumer, node)
        a = prompt(200, seed=2)
        await complete(http, node, a)
        await eventually(lambda: consumer.hits(a) == {"d0": 192}, what="the index holds the prompt's blocks")
        predicted = prompt_prefix_hits(consumer.index, a, consumer.clock())["d0"]
        again = await complete(http, node, a)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted == 192
        # A longer turn: the index predicts its hit before the node reports it.
        b = a + prompt(40, seed=3)
        predicted = consumer.hits(b)["d0"]
        assert (await complete(http, node, b))["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted == 192
        assert node.node.kv_events is not None and node.node.kv_events.published >= 2


async def test_a_subscriber_that_missed_batches_rebuilds_by_replay(
    model_dir: Path, http: aiohttp.ClientSession, consumer: KvEventConsumer
) -> None:
    async with running(model_dir, "d0", Role.DECODE, kv_events_config=EVENTS) as node:
        a = prompt(64, seed=4)
        await complete(http, node, a)  # published before anyone subscribed: batch 0 is missed live
        pub = node.node.kv_events
        assert pub is not None
        await eventually(lambda: pub.published >= 1, what="the first batch went out")
        # The replay socket answers as vLLM 0.32's: [topic, seq, payload] per batch, then the end.
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(endpoints(node).replay or "")
            await dealer.send_multipart((b"", encode_replay_request(0)))
            first = await dealer.recv_multipart()
            assert len(first) == 4 and first[1] == TOPIC.encode()
            seq, payload = decode_replay_reply(first[1:]) or (None, b"")
            (stored,) = decode_batch(payload).events
            assert seq == 0 and isinstance(stored, BlockStored)
            # All 4 full blocks are cached; a lookup of this very prompt hits 3 (its last token is computed).
            assert stored.token_ids == tuple(a) and stored.parent_block_hash is None and stored.block_size == BS
            frames = first
            while decode_replay_reply(frames[1:]) is not None:
                frames = await dealer.recv_multipart()
            assert frames[1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        finally:
            dealer.close(linger=0)
            ctx.destroy(linger=0)
        # The dispatcher's subscriber connects late, asks for a replay from 0 and has the blocks.
        await subscribe(consumer, node)
        await eventually(lambda: consumer.hits(a) == {"d0": 48}, what="the replayed blocks")
        assert consumer.subscribers["d0"].replays_asked >= 1 and pub.replays >= 2


async def test_a_keep_pulls_only_the_blocks_the_decode_node_lacks(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with (
        running(model_dir, "p0", Role.PREFILL, enable_prompt_tokens_details=True) as prefill,
        running(model_dir, "d0", Role.DECODE, enable_prompt_tokens_details=True) as decode,
    ):
        turn1 = prompt(130, seed=5)
        await complete(http, decode, turn1)  # the decode node served the previous turn: 8 blocks cached
        turn2 = turn1 + prompt(70, seed=6)
        hop1 = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        reply = await complete(http, prefill, turn2, **hop1)
        kv = reply["kv_transfer_params"]
        assert kv["remote_prefill_cached_tokens"] == 0 == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        done = await complete(http, decode, turn2, kv_transfer_params=kv)
        # vLLM's decode side reports the prefill side's hit, and takes its own from its cache.
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m = await metrics(http, decode.url)
        assert sample(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 200 - 128
        assert sample(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 128


async def test_caching_off_never_hits_and_publishes_nothing(
    model_dir: Path, http: aiohttp.ClientSession, consumer: KvEventConsumer
) -> None:
    overrides = {"prefix_caching": False, "enable_prompt_tokens_details": True, "kv_events_config": EVENTS}
    async with running(model_dir, "d0", Role.DECODE, **overrides) as node:
        await subscribe(consumer, node)
        a = prompt(100, seed=7)
        for _ in range(2):
            assert (await complete(http, node, a))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert node.node.kv_events is not None and node.node.kv_events.published == 0
        assert consumer.hits(a) == {"d0": 0} and consumer.index.stats("d0").cached_blocks == 0


def test_vllms_flags_configure_the_node(model_dir: Path) -> None:
    flags = ["--no-enable-prefix-caching", "--block-size", "32", "--enable-prompt-tokens-details"]
    node = ["--node-id", "d0", "--role", "decode", "--model-dir", str(model_dir)]
    args = build_parser().parse_args([*node, *flags, "--kv-events-config", EVENTS])
    flagged = SOURCE.load(overrides=flag_values(args, EmulatedNodeConfig), environ={})
    assert (flagged.prefix_caching, flagged.block_size, flagged.enable_prompt_tokens_details) == (False, 32, True)
    assert build_parser().parse_args(["--enable-prefix-caching"]).prefix_caching is True
    cfg = EmulatedNodeConfig("d0", Role.DECODE, str(model_dir), kv_events_config=EVENTS)
    assert cfg.prefix_caching and cfg.block_size == BS and cfg.kv_events == KvEventsConfig.from_json(EVENTS)
    assert EmulatedNodeConfig("d0", Role.DECODE, str(model_dir), kv_events_config="{}").kv_events is None
    with pytest.raises(ConfigError, match="unknown field `endpiont`"):
        EmulatedNodeConfig("d0", Role.DECODE, str(model_dir), kv_events_config='{"endpiont": "tcp://*:1"}')
    with pytest.raises(ConfigError, match="block_size"):
        EmulatedNodeConfig("d0", Role.DECODE, str(model_dir), block_size=0)
    bad = ["--node-id", "d0", "--role", "decode", "--model-dir", str(model_dir), "--kv-events-config", "{"]
    assert main(bad) == 2
