"""The emulated node's KV event publisher: vLLM 0.32's ``ZmqEventPublisher`` on the node's event
loop (``vllm/distributed/kv_events.py``; read, not copied), framed by :mod:`kairos.common.kv_events`.

- PUB socket: each batch goes out as ``[topic, seq, payload]``; the send never blocks (at the
  high-water mark ``hwm`` ZMQ drops, as vLLM's PUB does) and a subscriber that joins late misses
  what went before, which is what the replay is for.
- ROUTER replay socket (with ``replay_endpoint``): a request ``[identity, b"", start]`` is answered
  with every buffered batch ``seq >= start`` as ``[identity, b"", topic, seq, payload]``, then the
  end marker ``[identity, b"", b"", -1, b""]``; a malformed request is logged and dropped. The
  buffer keeps the last ``buffer_steps`` batches.
- Endpoints as vLLM treats them: a ``*`` (or ``::``, ``ipc://``, ``inproc://``) binds, anything
  else connects (the PUB side; the replay socket always binds). ``tcp://*:0`` binds a free port on
  the node's own address (vLLM: on its IP) and :attr:`pub_endpoint` says which.

vLLM's publisher runs in a thread behind a queue of ``max_queue_size`` batches; here the engine
and the sockets share one event loop, so a batch is sent as it is made and nothing queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

from kairos.common.aio import cancel_and_wait
from kairos.common.kv_events import (
    KvEventBatch,
    KvEventsConfig,
    encode_batch,
    encode_replay_reply,
    encode_seq,
    publisher_binds,
)

log = logging.getLogger("kairos.sim.kv_event_publisher")


def _bind(sock: zmq.Socket, endpoint: str, host: str) -> str:
    """Bind ``endpoint`` (``tcp://*:0`` on ``host``, a free port); the endpoint bound. A failure
    is an OSError, as a taken HTTP port is."""
    if endpoint == "tcp://*:0":
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        endpoint = f"tcp://{host}:0"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"kv events: cannot bind {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KvEventPublisher:
    """Publishes one node's KV event batches; :meth:`start` inside the node's event loop."""

    def __init__(self, config: KvEventsConfig, host: str) -> None:
        self.config = config
        self.host = host
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket | None = None  # a plain socket: a send never waits, so none is awaited
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.pub_endpoint: str | None = None  # as bound (or connected to)
        self.replay_endpoint: str | None = None
        self.published = 0  # batches sent
        self.replays = 0  # replay requests answered

    def start(self) -> None:
        cfg = self.config
        pub = self._pub = zmq.Socket(self._ctx, zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(cfg.hwm)
        if publisher_binds(cfg.endpoint):
            self.pub_endpoint = _bind(pub, cfg.endpoint, self.host)
        else:
            pub.connect(cfg.endpoint)
            self.pub_endpoint = cfg.endpoint
        if cfg.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, cfg.replay_endpoint, self.host)
            self._task = asyncio.create_task(self._serve_replays(self._replay), name="kv-events-replay")
        log.info("kv events on %s (replay %s, topic %r)", self.pub_endpoint, self.replay_endpoint, cfg.topic)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.destroy(linger=0)

    def publish(self, seq: int, batch: KvEventBatch) -> None:
        """Send one batch (its number from the engine: 0, 1, ... for the node's life) and keep it
        for replays."""
        if self._pub is None:
            return
        payload = encode_batch(batch)
        with contextlib.suppress(zmq.Again):  # past the high-water mark the batch is dropped, as vLLM's is
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: invalid replay request of %d frames dropped", len(frames))
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")  # as vLLM reads it
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart((client, b"", *encode_replay_reply(seq, payload, self.config.topic)))
            await router.send_multipart((client, b"", *encode_replay_reply(None)))
            self.replays += 1
