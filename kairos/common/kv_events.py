"""vLLM's KV cache events on the wire: the one encoder and the one decoder Kairos has for them.

A vLLM node started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'``
publishes every change to its prefix cache. The emulated node publishes through this module's
encoder, the dispatcher reads through its decoder, so the real and the emulated path are one.

Framing (ZMQ PUB): each batch is a three-frame message ``[topic, seq, payload]``: ``topic`` the
configured topic in UTF-8, ``seq`` the batch's sequence number as 8 bytes big-endian (0, 1, 2,
... from each publisher process: a restart starts again at 0), ``payload`` the msgpack batch.

Replay (ZMQ ROUTER beside the PUB socket): a client sends the first sequence number it wants as
8 bytes big-endian (the ROUTER sees ``[identity, b"", start]``, as from a REQ or a DEALER that
sends an empty delimiter first); the publisher answers one ``[topic, seq, payload]`` message per
batch still in its buffer (vLLM keeps the last ``buffer_steps``, 10,000 by default) with ``seq >=
start``, then the end marker ``[b"", -1 as 8 signed bytes, b""]`` (vLLM 0.32's
``_service_replay``; vLLM before it, and SGLang, send ``[seq, payload]`` and ``[-1, b""]``
without the topic: the decoder reads both). A replay that starts after ``start`` means the
batches between are gone.

Payload (msgpack, as vLLM 0.32's msgspec structs encode it): the batch is an array ``[ts,
events, data_parallel_rank]``; each event is a map tagged by its ``"type"`` key:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``lora_id``, ``medium``, ``lora_name`` always present, even when nil; ``extra_keys``,
``group_idx`` and later fields only when set), ``BlockRemoved`` (``block_hashes``, ``medium``,
``group_idx`` when set) and ``AllBlocksCleared``. vLLM before its PR #42892 wrote each event as
a tagged array instead (``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
medium, ...]``); the decoder reads both, and ignores map keys it does not know, so a node one
vLLM version ahead still decodes.

A block hash on the wire is an int (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
the low 64 bits of the 32-byte digest, big-endian) or the digest's bytes; :func:`block_key`
maps both to the int, the key every index uses (see :mod:`kairos.common.block_hash`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kairos.common.contracts import KV_EVENTS_ENDPOINT_PATTERN
from kairos.common.errors import ConfigError

KV_EVENTS_TOPIC = "kv-events"  # the topic Kairos configures its nodes with
MEDIUM_GPU = "GPU"  # the medium vLLM's GPU block pool writes on its events (offload tiers write others)
SEQ_BYTES = 8  # a sequence number's frame: unsigned, big-endian
REPLAY_END_SEQ = -1  # the replay's end marker, as 8 signed big-endian bytes
REPLAY_END_FRAME = REPLAY_END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True)
_KEY_MASK = (1 << 64) - 1

BlockHashWire = int | bytes  # vLLM's ExternalBlockHash


class MalformedKvEvents(ValueError):
    """A frame or payload that is not a vLLM KV event message; the message says which part."""


# -- events (vLLM 0.32's map form; Kairos's own definitions of the fields vLLM puts there) -----
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Full blocks newly cached, in chain order: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (nil for a prompt's first block), each next block's parent is the one
    before it; ``token_ids`` holds ``block_size`` tokens per block."""

    block_hashes: tuple[BlockHashWire, ...]
    parent_block_hash: BlockHashWire | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None  # vLLM writes these three even when nil
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None = None  # per block: LoRA, multimodal, cache_salt keys
    group_idx: int | None = None  # the KV cache group (0 on a single-group model)


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Blocks evicted from the prefix cache."""

    block_hashes: tuple[BlockHashWire, ...]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """The whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """One published message's payload: the events of one engine step, in order."""

    ts: float  # unix seconds at the publisher
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None  # vLLM's publisher sets its rank (0 without DP)


# -- the legacy array form (vLLM before #42892): decoded, then returned as the types above ------
class _LegacyBlockStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: tuple[BlockHashWire, ...]
    parent_block_hash: BlockHashWire | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # absent before vLLM added it
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # read so that a later array decodes; not kept
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: tuple[BlockHashWire, ...]
    medium: str | None = None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    """The older array form's ``["AllBlocksCleared"]``: a tag and no fields."""


class _LegacyBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    """The batch as a map (a publisher that dropped array_like on the batch too)."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KvEventBatch)
_LEGACY_DECODER = msgspec.msgpack.Decoder(_LegacyBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(_MapBatch)


def _from_legacy(event: Any) -> KvEvent:
    if isinstance(event, _LegacyBlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
        )
    if isinstance(event, _LegacyBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    return AllBlocksCleared()


def encode_batch(batch: KvEventBatch) -> bytes:
    """The msgpack payload of ``batch``, byte for byte as vLLM 0.32's publisher writes it."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KvEventBatch:
    """Decode a payload in vLLM's current form, its legacy array form, or with a map batch."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as current:
        try:
            legacy = _LEGACY_DECODER.decode(payload)
        except msgspec.DecodeError:
            try:
                mapped = _MAP_DECODER.decode(payload)
            except msgspec.DecodeError:
                raise MalformedKvEvents(f"KV event payload: {current}") from None
            return KvEventBatch(mapped.ts, mapped.events, mapped.data_parallel_rank)
        events = tuple(_from_legacy(e) for e in legacy.events)
        return KvEventBatch(legacy.ts, events, legacy.data_parallel_rank)


def block_key(block_hash: BlockHashWire) -> int:
    """The index key of a wire block hash: ints as they are, digests by vLLM's own conversion
    (the low 64 bits, big-endian), so a node publishing either form keys the same blocks."""
    if type(block_hash) is int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _KEY_MASK


# -- framing -----------------------------------------------------------------------------------
def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise MalformedKvEvents(f"sequence frame has {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def encode_message(topic: str, seq: int, batch: KvEventBatch) -> tuple[bytes, bytes, bytes]:
    """The PUB message's frames: topic, sequence number, payload."""
    return topic.encode("utf-8"), encode_seq(seq), encode_batch(batch)


def decode_message(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """``(topic, seq, payload)`` of a PUB message; the payload is decoded separately (a consumer
    checks the sequence before it pays for the batch)."""
    if len(frames) != 3:
        raise MalformedKvEvents(f"KV event message has {len(frames)} frames, not 3 (topic, seq, payload)")
    topic, seq, payload = frames
    try:
        name = bytes(topic).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedKvEvents("KV event topic is not UTF-8") from None
    return name, decode_seq(seq), bytes(payload)


# -- replay -------------------------------------------------------------------------------------
def encode_replay_request(start_seq: int) -> bytes:
    """The replay request's one frame: the first sequence number wanted."""
    return encode_seq(start_seq)


def decode_replay_request(frame: bytes) -> int:
    return decode_seq(frame)


def encode_replay_reply(seq: int | None, payload: bytes = b"", topic: str = "") -> tuple[bytes, bytes, bytes]:
    """One replayed batch ``[topic, seq, payload]`` as vLLM 0.32 sends it (after the client's
    identity and the empty delimiter), or with ``seq`` None the end marker ``[b"", -1, b""]``."""
    if seq is None:
        return b"", REPLAY_END_FRAME, b""
    return topic.encode("utf-8"), encode_seq(seq), payload


def decode_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a replayed batch, or None for the end marker: vLLM 0.32's
    ``[topic, seq, payload]`` or the older ``[seq, payload]``."""
    if len(frames) == 3:
        frames = frames[1:]  # the topic: the request already chose the stream
    if len(frames) != 2:
        raise MalformedKvEvents(f"replay reply has {len(frames)} frames, not 3 (topic, seq, payload) or 2")
    seq, payload = bytes(frames[0]), bytes(frames[1])
    if seq == REPLAY_END_FRAME:
        return None
    return decode_seq(seq), payload


# -- where a node publishes ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KvEventEndpoints:
    """A node's event sockets, as ZMQ endpoints a subscriber connects to."""

    pub: str  # e.g. tcp://10.0.0.5:5557: vLLM's --kv-events-config endpoint, its host filled in
    replay: str | None = None  # its replay_endpoint; None: gaps reset instead of replaying
    topic: str = KV_EVENTS_TOPIC


# -- how a node is told to publish ----------------------------------------------------------------
_PUBLISHERS = ("null", "zmq")


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM 0.32's ``--kv-events-config`` (``vllm/config/kv_events.py``): the same fields, the
    same defaults, from the same JSON. ``publisher`` defaults to "zmq" when events are enabled,
    "null" otherwise, as vLLM's ``__post_init__`` sets it."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # a "*" (or "::", ipc://, inproc://) binds; any other address connects
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in _PUBLISHERS:
            raise ValueError(f"publisher must be one of {list(_PUBLISHERS)}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def publishes(self) -> bool:
        """Whether a node with this configuration publishes on ZMQ (vLLM's EventPublisherFactory)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | bytes) -> KvEventsConfig:
        """Parse the flag's JSON; a field vLLM does not have, or a value of the wrong type, is a
        ValueError naming it (vLLM refuses both at start-up)."""
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as e:  # ValidationError included
            raise ValueError(f"--kv-events-config: {e}") from None

    def to_json(self) -> str:
        """The flag's JSON, every field written out."""
        return msgspec.json.encode(self).decode()


# -- where a node's events are subscribed to, as its heartbeat advertises it ---------------------
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
_ADVERTISABLE = re.compile(KV_EVENTS_ENDPOINT_PATTERN)


def advertised_endpoints(config: KvEventsConfig, host: str) -> KvEventEndpoints | None:
    """Where a subscriber connects to a node started with ``config`` (None: it publishes no
    events): each socket's wildcard host replaced by ``host``, the node's address others reach
    it at. vLLM binds its PUB socket only for a wildcard (``*``, ``::``) or ipc:// endpoint and
    otherwise connects out to it, which no subscriber could follow: a ConfigError; the replay
    socket is always bound."""
    if not config.publishes:
        return None
    if not publisher_binds(config.endpoint):
        raise ConfigError(
            f"KV events endpoint {config.endpoint!r}: vLLM connects its publisher to a concrete host; "
            "give a bind address such as tcp://*:5557 (the node's host is advertised in its place)"
        )
    replay = None if config.replay_endpoint is None else _connectable(config.replay_endpoint, host)
    return KvEventEndpoints(_connectable(config.endpoint, host), replay, config.topic)


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind for a wildcard or a local transport, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _connectable(endpoint: str, host: str) -> str:
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"KV events endpoint {endpoint!r}: expected tcp://host:port or ipc://path")
    bound, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"KV events endpoint {endpoint!r}: expected tcp://host:port")
    if bound in _WILDCARD_HOSTS:
        if not host:
            raise ConfigError(f"KV events endpoint {endpoint!r} binds every interface: a host to advertise is needed")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
        endpoint = f"tcp://{host}:{port}"
    if not _ADVERTISABLE.match(endpoint):  # what the heartbeat contract takes
        raise ConfigError(f"KV events endpoint {endpoint!r} is not one a subscriber can connect to")
    return endpoint


def host_of(hostport: str) -> str:
    """The host of a ``host:port`` address (brackets of an IPv6 one removed)."""
    return urlsplit(f"//{hostport}").hostname or ""
