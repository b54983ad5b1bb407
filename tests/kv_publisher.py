"""A KV event publisher speaking vLLM's wire format, for tests that play a node's prefix cache.

vLLM's ``ZmqEventPublisher`` reduced to what a test drives: a PUB socket sending
``[topic, seq, payload]`` with sequence numbers from 0, a ROUTER answering replays from its
buffer (in a thread of its own, so that sync and async tests alike can use it), each frame made
by :mod:`kairos.common.kv_events`, the codec the dispatcher decodes with. ``close()`` and a new
publisher on the same ports is a node restart (sequence numbers from 0 again).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import zmq

from kairos.common.block_hash import block_keys
from kairos.common.kv_events import (
    KV_EVENTS_TOPIC,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventEndpoints,
    decode_replay_request,
    encode_message,
    encode_replay_reply,
)

BLOCK_SIZE = 16  # vLLM's default


class VllmEventPublisher:
    def __init__(
        self,
        pub: str = "tcp://127.0.0.1:0",
        replay: str = "tcp://127.0.0.1:0",
        topic: str = KV_EVENTS_TOPIC,
        buffer_steps: int = 1000,
    ) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(pub)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay)
        self.endpoints = KvEventEndpoints(
            self.pub.getsockopt_string(zmq.LAST_ENDPOINT), self.router.getsockopt_string(zmq.LAST_ENDPOINT), topic
        )
        # The PUB and replay ports (a restarted publisher binds the same ones).
        self.ports = tuple(int(e.rpartition(":")[2]) for e in (self.endpoints.pub, self.endpoints.replay or ""))
        self.seq = 0
        self.replay_requests: list[int] = []
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload) for replays
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, name="kv-replay", daemon=True)
        self._thread.start()

    def publish(self, *events: KvEvent, send: bool = True) -> int:
        """One batch into the replay buffer and, unless ``send`` is False (a batch the subscribers
        miss live), out live; its sequence number."""
        with self._lock:
            seq = self.seq
            frames = encode_message(self.endpoints.topic, seq, KvEventBatch(1.0, events, 0))
            if send:
                self.pub.send_multipart(frames)
            self.buffer.append((seq, frames[2]))
            self.seq += 1
        return seq

    def store(self, token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> int:
        """The prompt's full blocks cached, in one ``BlockStored`` as vLLM publishes it."""
        keys = block_keys(token_ids, block_size)
        tokens = tuple(token_ids[: len(keys) * block_size])
        return self.publish(BlockStored(tuple(keys), None, tokens, block_size, None, "GPU", None))

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = decode_replay_request(start)
            with self._lock:
                self.replay_requests.append(first)
                replies = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            for seq, payload in replies:
                self.router.send_multipart((client, b"", *encode_replay_reply(seq, payload)))
            self.router.send_multipart((client, b"", *encode_replay_reply(None)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()
