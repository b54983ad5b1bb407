"""The dispatcher's KV event consumer (extproc.kv_events) against a fake vLLM publisher on real
ZMQ sockets on loopback: PUB for live batches, a ROUTER answering replays from its buffer, framed
and encoded by kairos.common.kv_events exactly as vLLM's ZmqEventPublisher does. Live events, a
gap repaired by replay, a replay that no longer holds the gap, AllBlocksCleared, a restart on the
same ports, and a publisher that goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kairos.common.block_hash import block_keys
from kairos.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventEndpoints,
    decode_replay_request,
    encode_message,
    encode_replay_reply,
)
from kairos.core.prefix_index import PrefixIndex
from kairos.extproc.kv_events import KvEventConsumer
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


class FakePublisher:
    """vLLM's publisher, reduced: sequence numbers from 0, a replay buffer of ``buffer_steps``
    batches, and ``publish(..., send=False)`` to buffer a batch the subscriber never gets live."""

    def __init__(self, ctx: zmq.asyncio.Context, pub: str, replay: str, buffer_steps: int = 100) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(pub)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay)
        self.endpoints = KvEventEndpoints(
            self.pub.getsockopt_string(zmq.LAST_ENDPOINT), self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replays())

    def publish(self, *events: KvEvent, send: bool = True) -> int:
        frames = encode_message(self.endpoints.topic, self.seq, KvEventBatch(1.0, events, 0))
        if send:
            self.pub.send_multipart(frames)
        self.buffer.append((self.seq, frames[2]))
        self.seq += 1
        return self.seq - 1

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = decode_replay_request(start)
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart((client, b"", *encode_replay_reply(seq, payload)))
            await self.router.send_multipart((client, b"", *encode_replay_reply(None)))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def consumer() -> AsyncIterator[KvEventConsumer]:
    c = KvEventConsumer(PrefixIndex(stale_after_s=5.0), replay_timeout_s=5.0)
    yield c
    await c.close()


async def hits_become(c: KvEventConsumer, prompt: list[int], want: dict[str, int]) -> None:
    await eventually(lambda: c.hits(prompt) == want, what=f"hits {want}")


async def start(zctx: zmq.asyncio.Context, c: KvEventConsumer, buffer_steps: int = 100) -> FakePublisher:
    pub = FakePublisher(zctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps)
    await c.set_nodes({"d0": pub.endpoints})
    await eventually(lambda: c.subscribers["d0"].connected and c.index.stats("d0").synced, what="connected")
    return pub


async def test_live_gap_replay_and_clear(zctx: zmq.asyncio.Context, consumer: KvEventConsumer) -> None:
    pub = await start(zctx, consumer)
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
    await pub.close()


async def test_gap_the_replay_no_longer_holds_resets(zctx: zmq.asyncio.Context, consumer: KvEventConsumer) -> None:
    pub = await start(zctx, consumer, buffer_steps=1)
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
    await pub.close()


async def test_restart_on_the_same_ports(zctx: zmq.asyncio.Context, consumer: KvEventConsumer) -> None:
    pub = await start(zctx, consumer)
    pub.publish(stored(PROMPT, 0, 8))
    await hits_become(consumer, PROMPT, {"d0": 8 * BS})
    endpoints = pub.endpoints
    await pub.close()
    await eventually(lambda: not consumer.subscribers["d0"].connected, what="disconnect seen")
    assert consumer.hits(PROMPT) == {"d0": 0}  # what the old process held is forgotten

    pub = FakePublisher(zctx, endpoints.pub, endpoints.replay or "")  # seq from 0 again
    pub.publish(stored(OTHER, 0, 4))
    await hits_become(consumer, OTHER, {"d0": 4 * BS})
    assert consumer.hits(PROMPT) == {"d0": 0}
    pub.publish(stored(PROMPT, 0, 1))
    await hits_become(consumer, PROMPT, {"d0": BS})
    await pub.close()


async def test_restart_seen_only_in_sequence_numbers(zctx: zmq.asyncio.Context, consumer: KvEventConsumer) -> None:
    """A batch numbered at or below the last one applied means a new publisher process."""
    pub = await start(zctx, consumer)
    for first in range(4):
        pub.publish(stored(PROMPT, first, first + 1))
    await hits_become(consumer, PROMPT, {"d0": 4 * BS})
    pub.seq, pub.buffer = 0, deque(maxlen=100)  # the same sockets, numbering from 0 again
    pub.publish(stored(OTHER, 0, 1))
    await hits_become(consumer, OTHER, {"d0": BS})
    assert consumer.hits(PROMPT) == {"d0": 0} and consumer.index.stats("d0").resets == 1
    await pub.close()


async def test_an_idle_connected_node_stays_fresh_and_a_lost_one_reads_zero(zctx: zmq.asyncio.Context) -> None:
    now = [0.0]
    c = KvEventConsumer(PrefixIndex(stale_after_s=1.0), clock=lambda: now[0])
    try:
        pub = await start(zctx, c)
        pub.publish(stored(PROMPT, 0, 8))
        await hits_become(c, PROMPT, {"d0": 8 * BS})
        now[0] = 100.0  # long past stale_after_s without an event: the connection vouches for it
        assert c.hits(PROMPT) == {"d0": 8 * BS}
        await pub.close()
        await eventually(lambda: not c.subscribers["d0"].connected, what="disconnect seen")
        assert c.hits(PROMPT) == {"d0": 0} and not c.index.stats("d0").connected
        await c.set_nodes({})
        assert c.index.nodes() == ()
    finally:
        await c.close()


async def test_a_malformed_batch_is_a_hole(zctx: zmq.asyncio.Context, consumer: KvEventConsumer) -> None:
    """A payload that does not decode, live and again in the replay, is dropped: the batches
    around it apply, the index resets over the hole (what it removed is unknown)."""
    pub = await start(zctx, consumer)
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
    await pub.close()
