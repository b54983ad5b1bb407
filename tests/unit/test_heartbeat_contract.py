"""The heartbeat contract: the publisher's encoder and the dispatcher's decoder agree, and the
decoder refuses every violation with a message that names it."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos.common.contracts import (
    Heartbeat,
    HeartbeatField,
    MalformedHeartbeat,
    Role,
    encode_heartbeat,
    parse_heartbeat,
)
from kairos.common.contracts._schema import FieldNames, decode_fields
from kairos.common.contracts.heartbeat import Count, _parse_heartbeat_checked

BEAT = Heartbeat(
    node_id="d0",
    role=Role.DECODE,
    url="10.0.0.1:8100",
    sidecar="10.0.0.1:8200",
    seq=42,
    sent_at=1_700_000_000.25,
    decode_tokens=7,
    kv_tokens=21_000,
    kv_capacity_tokens=100_000,
    queued_prefill_tokens=(2048, 512),
    scheduled_prefill_tokens=(900,),
    max_step_tokens=4096,
    model="tiny",
)


def test_a_parsed_heartbeat_is_one_object_out_of_the_collectors_sight() -> None:
    """A dispatcher at 1,000 nodes parses 10,000 heartbeats a second: the decoder builds the
    Heartbeat itself (no second object built from its values), which the cyclic collector never
    tracks, and which stays immutable."""
    hb = parse_heartbeat(encode_heartbeat(BEAT), "d0")
    assert type(hb) is Heartbeat and hb == BEAT
    assert not gc.is_tracked(hb)
    with pytest.raises(AttributeError):
        hb.seq = 43  # type: ignore[misc]


def test_encode_then_parse_is_the_identity() -> None:
    assert parse_heartbeat(encode_heartbeat(BEAT), "d0") == BEAT
    prefill = Heartbeat(**{**_fields(BEAT), "node_id": "p0", "role": Role.PREFILL, "sidecar": ""})
    assert parse_heartbeat(encode_heartbeat(prefill).encode(), "p0") == prefill  # bytes, as MGET returns


def test_optional_fields_are_left_out_when_unknown_and_round_trip_when_known() -> None:
    assert set(json.loads(encode_heartbeat(BEAT))) == set(HeartbeatField.REQUIRED)
    full = Heartbeat(
        **{
            **_fields(BEAT),
            "running_requests": 3,
            "waiting_requests": 0,
            "kv_usage": 0.25,
            "step_calibration": 1.25,
            "pending_kv_pull_tokens": (3000, 120),
            "scheduled_prefill_computed_tokens": (450,),
            "tpot_slo_ms": 60.0,
            "queued_prefill_computed_tokens": (100, 0),
            "running_step_elapsed_s": 0.0125,
            "running_kv_pull_elapsed_s": 0.25,
            "kv_events_endpoint": "tcp://10.0.0.1:5557",
            "kv_events_replay_endpoint": "tcp://10.0.0.1:5558",
            "kv_events_topic": "kv-events",
        }
    )
    raw = encode_heartbeat(full)
    assert set(json.loads(raw)) == set(HeartbeatField.REQUIRED) | set(HeartbeatField.OPTIONAL)
    assert parse_heartbeat(raw, "d0") == full


def _fields(hb: Heartbeat) -> dict[str, Any]:
    return {name: getattr(hb, name) for name in Heartbeat.__struct_fields__}


def _raw(**changes: Any) -> str:
    data = json.loads(encode_heartbeat(BEAT))
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("[]", "expected a JSON object"),
        ("{", "not JSON"),
        (json.dumps({"node_id": "d0"}), "missing fields"),
        (_raw(seq=-1), "seq must be an int >= 0"),
        (_raw(seq=True), "seq must be an int >= 0"),
        (_raw(sent_at="now"), "sent_at must be a number"),
        (_raw(queued_prefill_tokens=[1, True]), "queued_prefill_tokens must be a list of ints"),
        (_raw(pending_kv_pull_tokens=[1, -2]), "pending_kv_pull_tokens must be a list of ints"),
        (_raw(pending_kv_pull_tokens=5), "pending_kv_pull_tokens must be a list of ints"),
        (_raw(role="router"), "role must be 'prefill' or 'decode'"),
        (_raw(url=""), "url is empty"),
        (_raw(model=None), "model must be a string"),
        (_raw(max_step_tokens=0), "max_step_tokens must be an int >= 1"),
        (_raw(node_id="d1"), "node_id 'd1' does not match its key's 'd0'"),
        (_raw(sidecar=""), "a decode node needs a sidecar address"),
        (_raw(kv_usage=-0.5), "kv_usage must be a number >= 0"),
        (_raw(running_requests=1.5), "running_requests must be an int >= 0"),
        (_raw(step_calibration=0), "step_calibration must be a number in [0.25, 4.0]"),
        (_raw(step_calibration=4.5), "step_calibration must be a number in [0.25, 4.0]"),
        (_raw(step_calibration="1.2"), "step_calibration must be a number in [0.25, 4.0]"),
        (_raw(step_calibration=True), "step_calibration must be a number in [0.25, 4.0]"),
        # vLLM's bind address is not one to connect to: the publisher advertises its host instead
        (_raw(kv_events_endpoint="tcp://*:5557"), "kv_events_endpoint must be a ZMQ endpoint to connect to"),
        (_raw(kv_events_replay_endpoint="tcp://h:5558\n"), "kv_events_replay_endpoint must be a ZMQ endpoint"),
        (_raw(kv_events_endpoint=5557), "kv_events_endpoint must be a ZMQ endpoint"),
        (_raw(kv_events_topic=1), "kv_events_topic must be a string"),
    ],
)
def test_parse_heartbeat_rejects_contract_violations(raw: str, message: str) -> None:
    with pytest.raises(MalformedHeartbeat) as info:
        parse_heartbeat(raw, "d0")
    assert message in str(info.value)


def test_nan_sent_at_is_refused() -> None:
    raw = encode_heartbeat(BEAT).replace('"sent_at":1700000000.25', '"sent_at":NaN')
    with pytest.raises(MalformedHeartbeat, match="sent_at must be a number"):
        parse_heartbeat(raw, "d0")


_ANY_JSON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(
        st.one_of(st.integers(min_value=-5, max_value=10**20), st.booleans(), st.floats(), st.text(max_size=2)),
        max_size=3,
    ),
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(
    changes=st.dictionaries(st.sampled_from(Heartbeat.__struct_fields__), _ANY_JSON, max_size=3),
    dropped=st.sets(st.sampled_from(HeartbeatField.REQUIRED), max_size=1),
)
def test_the_fast_decoder_and_the_checked_one_give_the_same_verdict(changes: dict[str, Any], dropped: set[str]) -> None:
    """parse_heartbeat decodes with msgspec and falls back to the Python checks only for a value
    msgspec refuses: both must accept exactly the same heartbeats, as the same values."""
    data = {**json.loads(encode_heartbeat(BEAT)), **changes}
    for name in dropped:
        data.pop(name, None)
    raw = json.dumps(data)
    try:
        checked: Heartbeat | str = _parse_heartbeat_checked(raw)
    except MalformedHeartbeat:
        checked = "refused"
    try:
        fast: Heartbeat | str = parse_heartbeat(raw)
    except MalformedHeartbeat:
        fast = "refused"
    if isinstance(checked, Heartbeat) and (not checked.url or (checked.role is Role.DECODE and not checked.sidecar)):
        checked = "refused"  # parse_heartbeat's checks across fields, after either decoder
    assert fast == checked


def test_a_heartbeat_without_step_calibration_reads_as_not_reported() -> None:
    """A node older than the field (or with no latency model) sends none: the decoder gives None,
    which the dispatcher's membership turns into a calibration of 1.0 (Eq. 5 as the paper has it)."""
    assert "step_calibration" not in json.loads(encode_heartbeat(BEAT))
    assert parse_heartbeat(encode_heartbeat(BEAT), "d0").step_calibration is None
    assert parse_heartbeat(_raw(step_calibration=1), "d0").step_calibration == 1.0


# -- one declaration: the names, the encoder and the checked decoder's messages come from the struct


class _Extended(Heartbeat, frozen=True, gc=False, omit_defaults=True):
    """The heartbeat with one more field, as a change to the contract would add it."""

    rejected_requests: Count | None = None


class _ExtendedField(FieldNames, struct=_Extended):
    """Its names, derived from _Extended alone."""


def test_a_field_added_to_the_struct_is_named_encoded_and_checked_with_no_other_edit() -> None:
    assert _ExtendedField.REJECTED_REQUESTS == "rejected_requests"
    assert (*HeartbeatField.OPTIONAL, "rejected_requests") == _ExtendedField.OPTIONAL
    assert _ExtendedField.REQUIRED == HeartbeatField.REQUIRED
    extended = _Extended(**_fields(BEAT), rejected_requests=3)
    assert encode_heartbeat(extended) == encode_heartbeat(BEAT)[:-1] + ',"rejected_requests":3}'
    assert encode_heartbeat(_Extended(**_fields(BEAT))) == encode_heartbeat(BEAT)  # None: left out
    raw = json.loads(encode_heartbeat(extended)) | {"rejected_requests": -1}
    with pytest.raises(MalformedHeartbeat, match=r"^rejected_requests must be an int >= 0, got -1$"):
        decode_fields(raw, _Extended, MalformedHeartbeat)


def test_the_names_are_the_structs_fields_in_wire_order() -> None:
    assert (*HeartbeatField.REQUIRED, *HeartbeatField.OPTIONAL) == Heartbeat.__struct_fields__
    assert list(json.loads(encode_heartbeat(BEAT))) == list(HeartbeatField.REQUIRED)
    assert HeartbeatField.KV_EVENTS == ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic")
    with pytest.raises(TypeError, match="is not Heartbeat's field 'seq'"):

        class _Wrong(FieldNames, struct=Heartbeat):
            SEQ = "sequence"


@pytest.mark.parametrize("name", Heartbeat.__struct_fields__)
def test_every_fields_refusal_names_the_field_and_what_it_must_be(name: str) -> None:
    """A value of no field's type (an object) is refused by the fast decoder and the checked one
    alike, with a message naming that field, whichever field it is."""
    with pytest.raises(MalformedHeartbeat, match=rf"^{name} must be (a|an|'prefill') .*, got \{{\}}$"):
        parse_heartbeat(_raw(**{name: {}}), "d0")


def test_a_float_field_is_never_nan_or_infinite() -> None:
    """msgspec refuses both on the fast path; the checked decoder (for a heartbeat it takes there,
    here one with a 65-bit seq) refuses them too."""
    for value in ("NaN", "Infinity", "1e400"):
        raw = _raw(seq=2**65).replace('"kv_usage"', '"x"').replace("}", f',"kv_usage":{value}}}')
        with pytest.raises(MalformedHeartbeat, match="kv_usage must be a number >= 0"):
            parse_heartbeat(raw, "d0")
    assert parse_heartbeat(_raw(seq=2**65), "d0").seq == 2**65
