"""The heartbeat: one encoder (the node's publisher), one decoder (every dispatcher).

:class:`Heartbeat` is the schema: its fields are the JSON object's keys in wire order, their types
the contract's checks. :class:`HeartbeatField` (the names as constants), :func:`encode_heartbeat`
and :func:`parse_heartbeat` (and the messages it refuses a value with) derive from it; adding a
field is one line in the struct.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from kairos.common.contracts._checks import json_object
from kairos.common.contracts._schema import FieldNames, decode_fields
from kairos.common.contracts.role import Role

HEARTBEAT_PERIOD_S = 0.1  # Delta_h
HEARTBEAT_TTL_S = 0.5  # key expiry: five missed beats and the node is gone
# A node's step calibration (kairos.core.calibration) lies in this range: a quarter to four times
# its latency model. A value outside it is malformed; a heartbeat without it reads as 1.0.
STEP_CALIBRATION_MIN = 0.25
STEP_CALIBRATION_MAX = 4.0
# A node's advertised KV event sockets (kairos.common.kv_events): ZMQ endpoints a dispatcher
# connects to, so a concrete host (never vLLM's bind wildcard "*"), or an ipc:// path.
KV_EVENTS_ENDPOINT_PATTERN = r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}|ipc://[^\s]+)\Z"


class MalformedHeartbeat(ValueError):
    """A heartbeat value that does not follow the contract."""


# The contract's checks on a heartbeat's values, as msgspec constraints (the checked decoder's
# messages say them in words, kairos.common.contracts._schema.describe): counts >= 0, a step
# budget >= 1, a calibration in range, a TPOT in ms, endpoints a dispatcher can connect to.
Count = Annotated[int, msgspec.Meta(ge=0)]
Amount = Annotated[float, msgspec.Meta(ge=0)]
StepTokens = Annotated[int, msgspec.Meta(ge=1)]
Calibration = Annotated[float, msgspec.Meta(ge=STEP_CALIBRATION_MIN, le=STEP_CALIBRATION_MAX)]
SloMs = Annotated[float, msgspec.Meta(gt=0, extra={"unit": "milliseconds"})]
# A duration the engine measured, in seconds: as sent_at and as_of (and the step records' start and
# duration) are. Only the TPOT SLO is in milliseconds, the unit an SLO is set in.
ElapsedS = Annotated[float, msgspec.Meta(ge=0, extra={"unit": "seconds"})]
Endpoint = Annotated[
    str,
    msgspec.Meta(
        pattern=KV_EVENTS_ENDPOINT_PATTERN,
        description="a ZMQ endpoint to connect to (tcp://host:port or ipc://path)",
    ),
]


class Heartbeat(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One heartbeat, field by field in the order the JSON object carries them (all required
    unless they have a default; an optional field left at None is left out of the JSON).

    A msgspec struct whose field types carry the contract's checks, so that the dispatcher's
    decoder builds and checks a well-formed heartbeat in C: a poll parses 500 of them at 1,000
    nodes, and a frozen dataclass built from the decoded values cost twice the decode itself.
    Like a dataclass, building one in Python checks nothing. Out of the cyclic collector's
    sight (``gc=False``): it holds only strings, numbers and tuples of ints."""

    node_id: str  # unique in the cluster
    role: Role
    url: str  # host:port of the node's vLLM (or emulated vLLM) OpenAI server
    sidecar: str  # host:port of the decode sidecar ("" on prefill nodes)
    seq: Count  # +1 per beat from one publisher process (detects fresh beats)
    sent_at: float  # publisher's unix time (informational: ages use the receiver's clock)
    decode_tokens: Count  # B
    kv_tokens: Count  # K
    kv_capacity_tokens: Count
    queued_prefill_tokens: tuple[Count, ...]  # remaining per queued/prefilling request, FIFO
    scheduled_prefill_tokens: tuple[Count, ...]  # deflected prefills in progress
    max_step_tokens: StepTokens  # the node's token budget per step (chi_p on prefill nodes)
    model: str  # served model name
    # Optional: absent in older heartbeats. The engine's own request counts and KV usage as vLLM's
    # /metrics define them (num_requests_running, num_requests_waiting, kv_cache_usage_perc).
    running_requests: Count | None = None
    waiting_requests: Count | None = None
    kv_usage: Amount | None = None
    # The decode node's step calibration, the upper quantile of its actual / predicted step times
    # (kairos.core.calibration); the dispatcher plans its steps to beta x tau / this. None (a node
    # older than the field, or one with no latency model): the dispatcher reads 1.0.
    step_calibration: Calibration | None = None
    # Decode nodes: prompt tokens of each KV transfer the node has yet to finish pulling (queued on
    # or running over its inbound link), FIFO; the keep path's TTFT estimate queues a new transfer
    # behind them.
    pending_kv_pull_tokens: tuple[Count, ...] | None = None
    # Decode nodes: one per scheduled_prefill_tokens entry, in the same order: the prompt tokens
    # that deflected prefill has computed already (the chunks run, or a prefix cache hit), which
    # its remaining chunks attend to. A started prefill holds them in kv_tokens. None: each is
    # planned from nothing, as before the field.
    scheduled_prefill_computed_tokens: tuple[Count, ...] | None = None
    # Decode nodes: the tightest TPOT SLO among the node's requests in flight (running, waiting,
    # pulling their KV; one without its own counts as the cluster's default), Eq. 5's tau on the
    # node for a request of a looser TPOT. None: none in flight, or a node older than the field
    # (the dispatcher then takes the cluster default while it holds any).
    tpot_slo_ms: SloMs | None = None
    # One per queued_prefill_tokens entry, in the same order: the prompt tokens that queued
    # prefill has computed already (a prefill node's head, part done, or a prefix cache hit),
    # which its remaining chunks attend to (the keep path's queue estimate).
    queued_prefill_computed_tokens: tuple[Count, ...] | None = None
    # How long the engine step in flight had been running when the state was read (in the
    # heartbeat: when it was sent), seconds. The state's queues still count that step's tokens; the
    # dispatcher takes what is left of the step from this instead of half a step on average. A
    # duration, not a time: no clock is shared with the dispatcher. None: no step in flight (an idle
    # engine), or a node older than the field (the dispatcher then assumes half a step, as before).
    running_step_elapsed_s: ElapsedS | None = None
    # Decode nodes: how long the KV transfer in flight, the first of pending_kv_pull_tokens, had
    # been running then, seconds as above; the keep path's estimate takes what is left of it. None:
    # none in flight (the first waits for KV room), or a node older than the field (half done).
    running_kv_pull_elapsed_s: ElapsedS | None = None
    # From the publisher's config, not the engine's state: where the node publishes vLLM's KV
    # cache events (--kv-events-config), and their topic. None: no events, the dispatcher reads
    # the node's prefix hits as zero.
    kv_events_endpoint: Endpoint | None = None  # the PUB socket
    kv_events_replay_endpoint: Endpoint | None = None  # the replay ROUTER (None: none)
    kv_events_topic: str | None = None  # None: "" (vLLM's default, every topic)


class HeartbeatField(FieldNames, struct=Heartbeat):
    """The heartbeat's JSON keys (:class:`Heartbeat`'s fields): ``HeartbeatField.SEQ == "seq"``,
    ``REQUIRED`` and ``OPTIONAL`` in wire order, and ``KV_EVENTS``, the publisher's own."""

    KV_EVENTS: tuple[str, ...]


HeartbeatField.KV_EVENTS = tuple(name for name in HeartbeatField.OPTIONAL if name.startswith("kv_events_"))


def encode_heartbeat(hb: Heartbeat) -> str:
    """The heartbeat's compact JSON, as SET in :data:`REDIS_NODE_KEY` and PUBLISHed: the struct's
    fields in order, those left at None left out (the standard library's encoder, whose bytes
    every reader has seen: non-ASCII as ``\\u`` escapes)."""
    return json.dumps(msgspec.to_builtins(hb), separators=(",", ":"))


_HEARTBEAT_DECODER = msgspec.json.Decoder(Heartbeat)


def parse_heartbeat(raw: bytes | str, node_id: str | None = None) -> Heartbeat:
    """Parse and check one heartbeat JSON; ``node_id`` (from the key) must match its node_id."""
    try:
        hb = _HEARTBEAT_DECODER.decode(raw)  # never a NaN or an infinity: msgspec refuses both
    except (msgspec.DecodeError, UnicodeDecodeError):
        hb = _parse_heartbeat_checked(raw)  # names what is wrong (and takes what JSON allows beyond)
    else:
        check_prefixes(hb, MalformedHeartbeat)
    if node_id is not None and hb.node_id != node_id:
        raise MalformedHeartbeat(f"node_id {hb.node_id!r} does not match its key's {node_id!r}")
    if not hb.url:
        raise MalformedHeartbeat("url is empty")
    if hb.role is Role.DECODE and not hb.sidecar:
        raise MalformedHeartbeat("a decode node needs a sidecar address (the dispatcher routes to it)")
    return hb


def _parse_heartbeat_checked(raw: bytes | str) -> Heartbeat:
    """``parse_heartbeat``'s field checks in Python, for a value the fast decoder refused: the
    same verdict from the same declaration, with a message naming the field. (It takes integers
    beyond msgspec's 64 bits, which JSON allows.)"""
    hb = Heartbeat(**decode_fields(json_object(raw, MalformedHeartbeat), Heartbeat, MalformedHeartbeat))
    check_prefixes(hb, MalformedHeartbeat)
    return hb


def check_prefixes(values: Any, error: type[Exception], prefix: str = "") -> None:
    """A heartbeat's or engine state's computed prefixes, each list one per prefill it describes."""
    f = HeartbeatField
    for name, computed, listed in (
        (
            f.SCHEDULED_PREFILL_COMPUTED_TOKENS,
            values.scheduled_prefill_computed_tokens,
            values.scheduled_prefill_tokens,
        ),
        (f.QUEUED_PREFILL_COMPUTED_TOKENS, values.queued_prefill_computed_tokens, values.queued_prefill_tokens),
    ):
        if computed is not None and len(computed) != len(listed):
            raise error(f"{prefix}{name} has {len(computed)} entries for {len(listed)} scheduled prefills")
