"""The dispatcher's subscriptions to its nodes' KV cache events (ZMQ), into one prefix index.

Why here, in each dispatcher, and not on the node (the heartbeat publisher summarizing into
Redis): the lookup is on the request path and must be in memory, so every dispatcher replica
holds an index either way; reading the nodes directly keeps the events one hop old and puts no
central server in their way. Through Redis, every node's stream (at 1,000 nodes, tens of
thousands of batches a second while they are busy) would pass through one single-threaded
server and out again to every replica, and its replay would duplicate vLLM's own ZMQ replay.
ZMQ's PUB fans out to a few replicas natively; one I/O thread carries 1,000 subscriptions.
The cost: a node's event port has no authentication (vLLM's publisher offers none) and its
``BlockStored`` events carry prompt token ids, so the port must be reachable from the
dispatchers only (bind it to the node's private interface, firewall the rest), where Redis
has ACLs per node. Memory is bounded per node (:class:`~kairos.core.prefix_index.PrefixIndex`
capacity) and per stream (held batches, replay size).

Each node gets one asyncio task with a SUB socket (ZMQ heartbeats on, so a peer that vanished
without closing is noticed), a monitor of its connection, and a DEALER for replays; what they
receive goes through :class:`~kairos.core.kv_event_sync.EventStreamSync`, which owns the rules.
While the SUB socket is connected the node stays fresh in the index (an idle node sends no
events); once it is not, the node's hits read zero after ``stale_after_s``. A task wakes only
for what its sockets receive and for a replay's deadline: 1,000 idle nodes cost no wake-ups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kairos.common import defaults
from kairos.common.aio import cancel_and_wait
from kairos.common.kv_events import (
    KvEventBatch,
    KvEventEndpoints,
    MalformedKvEvents,
    decode_batch,
    decode_message,
    decode_replay_reply,
    encode_replay_request,
)
from kairos.core.kv_event_sync import EventStreamSync, ReplayRequest
from kairos.core.prefix_index import PrefixIndex, prompt_prefix_hits

log = logging.getLogger("kairos.extproc.kv_events")

ZMQ_HEARTBEAT_IVL_MS = 100
ZMQ_HEARTBEAT_TIMEOUT_MS = 500  # a peer silent this long is disconnected (as a heartbeat TTL)
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class NodeEventSubscriber:
    """One node's subscription; :meth:`run` until cancelled."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        sync: EventStreamSync,
        endpoints: KvEventEndpoints,
        clock: Callable[[], float],
        replay_timeout_s: float = defaults.KV_EVENTS_REPLAY_TIMEOUT_S,
    ) -> None:
        self.ctx = ctx
        self.sync = sync
        self.endpoints = endpoints
        self.clock = clock
        self.replay_timeout_s = replay_timeout_s
        self.connected = False
        self.malformed = 0  # messages that did not decode (each then reads as a gap)
        self.replays_asked = 0
        self._dealer: zmq.asyncio.Socket | None = None
        self._replay_deadline: float | None = None
        self._replies: list[tuple[int, KvEventBatch]] = []

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
        monitor = sub.get_monitor_socket(_MONITORED)
        sub.connect(self.endpoints.pub)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                timeout_ms = -1  # none: wait for a message or a connection event
                if self._replay_deadline is not None:
                    timeout_ms = max(0, round((self._replay_deadline - self.clock()) * 1000))
                ready = dict(await poller.poll(timeout_ms))
                if monitor in ready:
                    await self._on_monitor(monitor, poller)
                if sub in ready:
                    await self._on_live(sub, poller)
                if self._dealer is not None and self._dealer in ready:
                    await self._on_replies(poller)
                now = self.clock()
                if self._replay_deadline is not None and now >= self._replay_deadline:
                    log.warning(
                        "kv events %s: replay unanswered in %.1f s: reset", self.sync.node_id, self.replay_timeout_s
                    )
                    self._drop_dealer(poller)
                    self.sync.on_replay_failed(now)
        finally:
            self._drop_dealer(poller)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket, poller: zmq.asyncio.Poller) -> None:
        while await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            now = self.clock()
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self.sync.index.set_connected(self.sync.node_id, True, now)
                self._ask(self.sync.on_connect(now), poller)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.sync.index.set_connected(self.sync.node_id, False, now)
                self._drop_dealer(poller)
                self.sync.on_disconnect(now)

    async def _on_live(self, sub: zmq.asyncio.Socket, poller: zmq.asyncio.Poller) -> None:
        while await sub.poll(0):
            frames = await sub.recv_multipart()
            try:
                _, seq, payload = decode_message(frames)
                batch = decode_batch(payload)
            except MalformedKvEvents as e:
                self.malformed += 1
                log.warning("kv events %s: dropped a message: %s", self.sync.node_id, e)
                continue  # the next batch reads as a gap
            self._ask(self.sync.on_live(seq, batch, self.clock()), poller)

    async def _on_replies(self, poller: zmq.asyncio.Poller) -> None:
        dealer = self._dealer
        while dealer is not None and await dealer.poll(0):
            frames = await dealer.recv_multipart()
            try:
                reply = decode_replay_reply(frames[1:])  # the DEALER keeps the empty delimiter
                if reply is not None:
                    self._replies.append((reply[0], decode_batch(reply[1])))
            except MalformedKvEvents as e:
                self.malformed += 1
                log.warning("kv events %s: dropped a replayed batch: %s", self.sync.node_id, e)
                continue  # a hole the sync resets over
            if len(self._replies) > self.sync.max_pending:
                del self._replies[0]
            if reply is None:
                replies, self._replies = self._replies, []
                self._replay_deadline = None
                self.sync.on_replay(replies, self.clock())
                return

    def _ask(self, request: ReplayRequest | None, poller: zmq.asyncio.Poller) -> None:
        if request is None:
            return
        # From 0: a (re)connection. Past 0: a batch went missing from the live stream, which a
        # healthy node never causes: say so, so that a later reset has its cause in the log.
        log.log(
            logging.WARNING if request.start_seq > 0 else logging.INFO,
            "kv events %s: asking for a replay from seq %d",
            self.sync.node_id,
            request.start_seq,
        )
        if self.endpoints.replay is None:
            self.sync.on_replay_failed(self.clock())
            return
        if self._dealer is None:
            self._dealer = self.ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.endpoints.replay)
            poller.register(self._dealer, zmq.POLLIN)
        self._replies = []
        self._replay_deadline = self.clock() + self.replay_timeout_s
        self.replays_asked += 1
        self._dealer.send_multipart((b"", encode_replay_request(request.start_seq)))

    def _drop_dealer(self, poller: zmq.asyncio.Poller) -> None:
        """Close the replay socket, so that late replies to an abandoned request never arrive."""
        if self._dealer is not None:
            poller.unregister(self._dealer)
            self._dealer.close(linger=0)
            self._dealer = None
        self._replay_deadline = None
        self._replies = []


class KvEventConsumer:
    """Every node's subscription, one :class:`PrefixIndex` for all; :meth:`hits` for a prompt."""

    def __init__(
        self,
        index: PrefixIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        replay_timeout_s: float = defaults.KV_EVENTS_REPLAY_TIMEOUT_S,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.clock = clock
        self.replay_timeout_s = replay_timeout_s
        self.ctx = zmq.asyncio.Context()
        self.subscribers: dict[str, NodeEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def set_nodes(self, nodes: Mapping[str, KvEventEndpoints]) -> None:
        """Subscribe to exactly these nodes: new ones start empty, changed endpoints start over,
        the others are dropped with their blocks."""
        for node_id in list(self.subscribers):
            if nodes.get(node_id) != self.subscribers[node_id].endpoints:
                await self._drop(node_id)
                log.info("kv events of %s: unsubscribed, its index dropped", node_id)
        for node_id, endpoints in nodes.items():
            if node_id in self.subscribers:
                continue
            log.info("kv events of %s: subscribing at %s (replay %s)", node_id, endpoints.pub, endpoints.replay)
            self.index.add_node(node_id, self.clock())
            sub = NodeEventSubscriber(
                self.ctx, EventStreamSync(self.index, node_id), endpoints, self.clock, self.replay_timeout_s
            )
            self.subscribers[node_id] = sub
            self._tasks[node_id] = asyncio.create_task(sub.run(), name=f"kv-events-{node_id}")

    async def _drop(self, node_id: str) -> None:
        await cancel_and_wait(self._tasks.pop(node_id))
        del self.subscribers[node_id]
        self.index.remove_node(node_id)

    def indexing(self) -> bool:
        """Some node's blocks are indexed (its first stored event set its block size)."""
        return bool(self.index.block_sizes())

    def report(self, node_id: str) -> dict[str, object] | None:
        """The node's subscription and index for ``/nodes`` (None: not subscribed)."""
        sub = self.subscribers.get(node_id)
        if sub is None:
            return None
        stats = self.index.stats(node_id)
        return {
            "endpoint": sub.endpoints.pub,
            "connected": sub.connected,
            "fresh": self.index.fresh(node_id, self.clock()),
            "synced": stats.synced,
            "cached_blocks": stats.cached_blocks,
            "block_size": stats.block_size,
            "resets": stats.resets,
            "gaps": sub.sync.gaps,
            "malformed": sub.malformed,
        }

    def hits(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per node, the prompt's leading tokens in its prefix cache (0 where stale)."""
        return prompt_prefix_hits(self.index, token_ids, self.clock())

    async def close(self) -> None:
        for node_id in list(self.subscribers):
            await self._drop(node_id)
        self.ctx.destroy(linger=0)
