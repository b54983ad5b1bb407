"""The dispatcher's KV event consumer (extproc.kv_events) against a fake vLLM publisher on real
ZMQ sockets on loopback: PUB for live batches, a ROUTER answering replays from its buffer, framed
and encoded by kairos.common.kv_events exactly as vLLM's ZmqEventPublisher does. Live events, a
gap repaired by replay, a replay that no longer holds the gap, AllBlocksCleared, a restart on the
same ports, and a publisher that goes away."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator

import pytest

from kairos.common.block_hash import block_keys
from kairos.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    encode_message,
)
from kairos.core.prefix_index import PrefixIndex
from kairos.extproc.kv_events import KvEventConsumer
from tests.kv_publisher import VllmEventPublisher
from tests.waiting import eventually

BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS + 1))  # 8 full blocks and a token (vLLM never hits the last one)
KEYS = block_keys(PROMPT, BS)
OTHER = list(range(5000, 5000 + 4 * BS + 1))


def stored(prompt: list[int], first: int, last: int) -> BlockStored:
    keys = block_keys(prompt, BS)
    return BlockStored(
        tuple(keys[first:last]),
        keys[first - 1] if first else None,
        tuple(prompt[first * BS : last * BS]),
        BS,
        None,
        "GPU",
        None,
        group_idx=0,
    )


@pytest.fixture
async def consumer() -> AsyncIterator[KvEventConsumer]:
    c = KvEventConsumer(PrefixIndex(stale_after_s=5.0), replay_timeout_s=5.0)
    yield c
    await c.close()


async def hits_become(c: KvEventConsumer, prompt: list[int], want: dict[str, int]) -> None:
    await eventually(lambda: c.hits(prompt) == want, what=f"hits {want}")


async def start(c: KvEventConsumer, buffer_steps: int = 100) -> VllmEventPublisher:
    pub = VllmEventPublisher(buffer_steps=buffer_steps)
    await c.set_nodes({"d0": pub.endpoints})
    await eventually(lambda: c.subscribers["d0"].connected and c.index.stats("d0").synced, what="connected")
    return pub


async def test_live_gap_replay_and_clear(consumer: KvEventConsumer) -> None:
    pub = await start(consumer)
    assert pub.replay_requests == [0]  # a new connection rebuilds from the publisher's buffer
    pub.publish(stored(PROMPT, 0, 2))
    pub.publish(stored(PROMPT, 2, 4))
    await hits_become(consumer, PROMPT, {"d0": 4 * BS})

    pub.publish(stored(PROMPT, 4, 6), send=False)  # lost on the way
    pub.publish(stored(PROMPT, 6, 8))
    await hits_become(consumer, PROMPT, {"d0": 8 * BS})
    assert pub.replay_requests == [0, 2]  # from the first batch missed
    assert consumer.index.stats("d0").resets == 0 and consumer.subscribers["d0"].sync.gaps == 1

    pub.publish(BlockRemoved((KEYS[3],), "GPU", 0))
    await hits_become(consumer, PROMPT, {"d0": 3 * BS})
    pub.publish(AllBlocksCleared())
    await hits_become(consumer, PROMPT, {"d0": 0})
    pub.publish(stored(OTHER, 0, 4))
    await hits_become(consumer, OTHER, {"d0": 4 * BS})
    pub.close()


async def test_gap_the_replay_no_longer_holds_resets(consumer: KvEventConsumer) -> None:
    pub = await start(consumer, buffer_steps=1)
    pub.publish(stored(PROMPT, 0, 8))
    await hits_become(consumer, PROMPT, {"d0": 8 * BS})
    pub.publish(BlockRemoved((KEYS[0],), "GPU", 0), send=False)  # gone from the buffer by the replay
    pub.publish(stored(OTHER, 0, 2), send=False)
    pub.publish(stored(OTHER, 2, 4))
    await eventually(lambda: consumer.index.stats("d0").resets == 1, what="a reset")
    assert consumer.hits(PROMPT) == {"d0": 0}  # what the lost batch removed is not claimed
    assert consumer.index.stats("d0").cached_blocks == 2  # OTHER's blocks 2-3; 0-1 were in a lost batch
    assert consumer.hits(OTHER) == {"d0": 0}  # so an under-count, never a wrong hit
    assert consumer.subscribers["d0"].sync.last_seq == 3
    pub.publish(stored(OTHER, 0, 2))
    await hits_become(consumer, OTHER, {"d0": 4 * BS})
    pub.close()


async def test_restart_on_the_same_ports(consumer: KvEventConsumer) -> None:
    pub = await start(consumer)
    pub.publish(stored(PROMPT, 0, 8))
    await hits_become(consumer, PROMPT, {"d0": 8 * BS})
    endpoints = pub.endpoints
    pub.close()
    await eventually(lambda: not consumer.subscribers["d0"].connected, what="disconnect seen")
    assert consumer.hits(PROMPT) == {"d0": 0}  # what the old process held is forgotten

    pub = VllmEventPublisher(endpoints.pub, endpoints.replay or "")  # seq from 0 again
    pub.publish(stored(OTHER, 0, 4))
    await hits_become(consumer, OTHER, {"d0": 4 * BS})
    assert consumer.hits(PROMPT) == {"d0": 0}
    pub.publish(stored(PROMPT, 0, 1))
    await hits_become(consumer, PROMPT, {"d0": BS})
    pub.close()


async def test_restart_seen_only_in_sequence_numbers(consumer: KvEventConsumer) -> None:
    """A batch numbered at or below the last one applied means a new publisher process."""
    pub = await start(consumer)
    for first in range(4):
        pub.publish(stored(PROMPT, first, first + 1))
    await hits_become(consumer, PROMPT, {"d0": 4 * BS})
    pub.seq, pub.buffer = 0, deque(maxlen=100)  # the same sockets, numbering from 0 again
    pub.publish(stored(OTHER, 0, 1))
    await hits_become(consumer, OTHER, {"d0": BS})
    assert consumer.hits(PROMPT) == {"d0": 0} and consumer.index.stats("d0").resets == 1
    pub.close()


async def test_an_idle_connected_node_stays_fresh_and_a_lost_one_reads_zero() -> None:
    now = [0.0]
    c = KvEventConsumer(PrefixIndex(stale_after_s=1.0), clock=lambda: now[0])
    try:
        pub = await start(c)
        pub.publish(stored(PROMPT, 0, 8))
        await hits_become(c, PROMPT, {"d0": 8 * BS})
        now[0] = 100.0  # long past stale_after_s without an event: the connection vouches for it
        assert c.hits(PROMPT) == {"d0": 8 * BS}
        pub.close()
        await eventually(lambda: not c.subscribers["d0"].connected, what="disconnect seen")
        assert c.hits(PROMPT) == {"d0": 0} and not c.index.stats("d0").connected
        await c.set_nodes({})
        assert c.index.nodes() == ()
    finally:
        await c.close()


async def test_a_malformed_batch_is_a_hole(consumer: KvEventConsumer) -> None:
    """A payload that does not decode, live and again in the replay, is dropped: the batches
    around it apply, the index resets over the hole (what it removed is unknown)."""
    pub = await start(consumer)
    pub.publish(stored(PROMPT, 0, 8))
    await hits_become(consumer, PROMPT, {"d0": 8 * BS})
    frames = encode_message(pub.endpoints.topic, pub.seq, KvEventBatch(1.0, (), 0))
    pub.pub.send_multipart((frames[0], frames[1], b"\xc1 not msgpack"))
    pub.buffer.append((pub.seq, b"\xc1 not msgpack"))
    pub.seq += 1
    pub.publish(stored(OTHER, 0, 4))
    await hits_become(consumer, OTHER, {"d0": 4 * BS})
    sub = consumer.subscribers["d0"]
    assert sub.malformed == 2 and consumer.index.stats("d0").resets == 1 and pub.replay_requests == [0, 1]
    assert consumer.hits(PROMPT) == {"d0": 0}
    pub.close()
