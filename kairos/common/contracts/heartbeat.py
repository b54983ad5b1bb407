"""The heartbeat: one encoder (the node's publisher), one decoder (every dispatcher)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kairos.common.contracts._checks import json_object, list_or_none
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
_KV_EVENTS_ENDPOINT = re.compile(KV_EVENTS_ENDPOINT_PATTERN)


class HeartbeatField:
    """Fields of the heartbeat JSON object (all required unless noted)."""

    NODE_ID = "node_id"  # str, unique in the cluster
    ROLE = "role"  # "prefill" or "decode"
    URL = "url"  # host:port of the node's vLLM (or emulated vLLM) OpenAI server
    SIDECAR = "sidecar"  # host:port of the decode sidecar ("" on prefill nodes)
    SEQ = "seq"  # int, +1 per beat from one publisher process (detects fresh beats)
    SENT_AT = "sent_at"  # float unix seconds when published (informational; ages use receipt time)
    DECODE_TOKENS = "decode_tokens"  # B
    KV_TOKENS = "kv_tokens"  # K
    KV_CAPACITY_TOKENS = "kv_capacity_tokens"
    QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"  # list[int], remaining per queued/prefilling request
    SCHEDULED_PREFILL_TOKENS = "scheduled_prefill_tokens"  # list[int], deflected prefills in progress
    MAX_STEP_TOKENS = "max_step_tokens"  # the node's token budget per step (chi_p on prefill nodes)
    MODEL = "model"  # served model name
    # Optional: the engine's own request counts and KV usage as vLLM's /metrics define them
    # (num_requests_running, num_requests_waiting, kv_cache_usage_perc), for operators.
    RUNNING_REQUESTS = "running_requests"
    WAITING_REQUESTS = "waiting_requests"
    KV_USAGE = "kv_usage"
    # Optional: the decode node's step calibration, the upper quantile of its actual / predicted
    # step times (kairos.core.calibration); the dispatcher plans its steps to beta x tau / this.
    # Absent (a node older than the field, or one with no latency model): 1.0.
    STEP_CALIBRATION = "step_calibration"
    # Optional, decode nodes: list[int], prompt tokens of each KV transfer the node has yet to
    # finish pulling (queued on or running over its inbound link), FIFO; the keep path's TTFT
    # estimate queues a new transfer behind them. Absent: none reported.
    PENDING_KV_PULL_TOKENS = "pending_kv_pull_tokens"
    # Optional, decode nodes: list[int], one per SCHEDULED_PREFILL_TOKENS entry, in the same order:
    # the prompt tokens that deflected prefill has computed already (the chunks run, or a prefix
    # cache hit), which its remaining chunks attend to. A started prefill holds them in kv_tokens.
    # Absent: none reported (each planned from nothing, as before the field).
    SCHEDULED_PREFILL_COMPUTED_TOKENS = "scheduled_prefill_computed_tokens"
    # Optional, decode nodes: float ms > 0, the tightest TPOT SLO among the node's requests in
    # flight (running, waiting, pulling their KV; one without its own counts as the cluster's
    # default), Eq. 5's tau on the node for a request of a looser TPOT. Absent: none in flight, or
    # a node older than the field (the dispatcher then takes the cluster default while it holds any).
    TPOT_SLO_MS = "tpot_slo_ms"
    # Optional: list[int], one per QUEUED_PREFILL_TOKENS entry, in the same order: the prompt
    # tokens that queued prefill has computed already (a prefill node's head, part done, or a
    # prefix cache hit), which its remaining chunks attend to (the keep path's queue estimate).
    # Absent: none reported.
    QUEUED_PREFILL_COMPUTED_TOKENS = "queued_prefill_computed_tokens"
    # Optional: where the node publishes vLLM's KV cache events (--kv-events-config), as ZMQ
    # endpoints a dispatcher connects to (KV_EVENTS_ENDPOINT_PATTERN), and their topic. Absent:
    # no events, the dispatcher reads the node's prefix hits as zero.
    KV_EVENTS_ENDPOINT = "kv_events_endpoint"  # the PUB socket
    KV_EVENTS_REPLAY_ENDPOINT = "kv_events_replay_endpoint"  # the replay ROUTER (absent: none)
    KV_EVENTS_TOPIC = "kv_events_topic"  # absent: "" (vLLM's default, every topic)
    # From the publisher's config, not the engine's state.
    KV_EVENTS = (KV_EVENTS_ENDPOINT, KV_EVENTS_REPLAY_ENDPOINT, KV_EVENTS_TOPIC)
    OPTIONAL = (
        RUNNING_REQUESTS,
        WAITING_REQUESTS,
        KV_USAGE,
        STEP_CALIBRATION,
        PENDING_KV_PULL_TOKENS,
        SCHEDULED_PREFILL_COMPUTED_TOKENS,
        TPOT_SLO_MS,
        QUEUED_PREFILL_COMPUTED_TOKENS,
        *KV_EVENTS,
    )

    ALL = (
        NODE_ID,
        ROLE,
        URL,
        SIDECAR,
        SEQ,
        SENT_AT,
        DECODE_TOKENS,
        KV_TOKENS,
        KV_CAPACITY_TOKENS,
        QUEUED_PREFILL_TOKENS,
        SCHEDULED_PREFILL_TOKENS,
        MAX_STEP_TOKENS,
        MODEL,
    )


# ---------------------------------------------------------------------------------------------
# The heartbeat: one encoder (the node's publisher), one decoder (every dispatcher)
# ---------------------------------------------------------------------------------------------
class MalformedHeartbeat(ValueError):
    """A heartbeat value that does not follow the contract."""


# The contract's checks on a heartbeat's values, as msgspec constraints: counts >= 0, a step
# budget >= 1, a calibration in range, endpoints a dispatcher can connect to.
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Amount = Annotated[float, msgspec.Meta(ge=0)]
_StepTokens = Annotated[int, msgspec.Meta(ge=1)]
_Calibration = Annotated[float, msgspec.Meta(ge=STEP_CALIBRATION_MIN, le=STEP_CALIBRATION_MAX)]
_SloMs = Annotated[float, msgspec.Meta(gt=0)]
_Endpoint = Annotated[str, msgspec.Meta(pattern=KV_EVENTS_ENDPOINT_PATTERN)]


class Heartbeat(msgspec.Struct, frozen=True, gc=False):
    """One heartbeat (every :class:`HeartbeatField`, by the same names).

    A msgspec struct whose field types carry the contract's checks, so that the dispatcher's
    decoder builds and checks a well-formed heartbeat in C: a poll parses 500 of them at 1,000
    nodes, and a frozen dataclass built from the decoded values cost twice the decode itself.
    Like a dataclass, building one in Python checks nothing. Out of the cyclic collector's
    sight (``gc=False``): it holds only strings, numbers and tuples of ints."""

    node_id: str
    role: Role
    url: str  # host:port of the node's vLLM server
    sidecar: str  # host:port of the decode sidecar ("" on prefill nodes)
    seq: _Count
    sent_at: float  # publisher's unix time (informational: ages use the receiver's clock)
    decode_tokens: _Count
    kv_tokens: _Count
    kv_capacity_tokens: _Count
    queued_prefill_tokens: tuple[_Count, ...]
    scheduled_prefill_tokens: tuple[_Count, ...]
    max_step_tokens: _StepTokens
    model: str
    # Optional: absent in older heartbeats.
    running_requests: _Count | None = None
    waiting_requests: _Count | None = None
    kv_usage: _Amount | None = None
    step_calibration: _Calibration | None = None  # None: not reported (the dispatcher reads 1.0)
    pending_kv_pull_tokens: tuple[_Count, ...] | None = None
    scheduled_prefill_computed_tokens: tuple[_Count, ...] | None = None
    tpot_slo_ms: _SloMs | None = None  # None: not reported
    queued_prefill_computed_tokens: tuple[_Count, ...] | None = None
    kv_events_endpoint: _Endpoint | None = None
    kv_events_replay_endpoint: _Endpoint | None = None
    kv_events_topic: str | None = None


def encode_heartbeat(hb: Heartbeat) -> str:
    """The heartbeat's compact JSON, as SET in :data:`REDIS_NODE_KEY` and PUBLISHed."""
    f = HeartbeatField
    beat: dict[str, Any] = {
        f.NODE_ID: hb.node_id,
        f.ROLE: str(hb.role),
        f.URL: hb.url,
        f.SIDECAR: hb.sidecar,
        f.SEQ: hb.seq,
        f.SENT_AT: hb.sent_at,
        f.DECODE_TOKENS: hb.decode_tokens,
        f.KV_TOKENS: hb.kv_tokens,
        f.KV_CAPACITY_TOKENS: hb.kv_capacity_tokens,
        f.QUEUED_PREFILL_TOKENS: list(hb.queued_prefill_tokens),
        f.SCHEDULED_PREFILL_TOKENS: list(hb.scheduled_prefill_tokens),
        f.MAX_STEP_TOKENS: hb.max_step_tokens,
        f.MODEL: hb.model,
    }
    optional = {
        f.RUNNING_REQUESTS: hb.running_requests,
        f.WAITING_REQUESTS: hb.waiting_requests,
        f.KV_USAGE: hb.kv_usage,
        f.STEP_CALIBRATION: hb.step_calibration,
        f.PENDING_KV_PULL_TOKENS: None if hb.pending_kv_pull_tokens is None else list(hb.pending_kv_pull_tokens),
        f.SCHEDULED_PREFILL_COMPUTED_TOKENS: list_or_none(hb.scheduled_prefill_computed_tokens),
        f.TPOT_SLO_MS: hb.tpot_slo_ms,
        f.QUEUED_PREFILL_COMPUTED_TOKENS: list_or_none(hb.queued_prefill_computed_tokens),
        f.KV_EVENTS_ENDPOINT: hb.kv_events_endpoint,
        f.KV_EVENTS_REPLAY_ENDPOINT: hb.kv_events_replay_endpoint,
        f.KV_EVENTS_TOPIC: hb.kv_events_topic,
    }
    beat |= {k: v for k, v in optional.items() if v is not None}
    return json.dumps(beat, separators=(",", ":"))


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
        _check_computed(prefix + name, computed, listed, error)


def _check_computed(
    name: str, computed: tuple[int, ...] | None, scheduled: tuple[int, ...], error: type[Exception]
) -> None:
    """The computed prefixes, when reported, are one per scheduled prefill."""
    if computed is not None and len(computed) != len(scheduled):
        raise error(f"{name} has {len(computed)} entries for {len(scheduled)} scheduled prefills")


def _hb_int(data: Mapping[str, Any], name: str, minimum: int = 0) -> int:
    value = data[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MalformedHeartbeat(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _hb_str(data: Mapping[str, Any], name: str) -> str:
    value = data[name]
    if not isinstance(value, str):
        raise MalformedHeartbeat(f"{name} must be a string, got {value!r}")
    return value


def _hb_ints(data: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = data[name]
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise MalformedHeartbeat(f"{name} must be a list of ints >= 0, got {value!r}")
    return tuple(value)


def _hb_optional(data: Mapping[str, Any], name: str, kind: type) -> Any:
    value = data.get(name)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok or (kind is int and not isinstance(value, int)):
        raise MalformedHeartbeat(f"{name} must be {'an int' if kind is int else 'a number'} >= 0, got {value!r}")
    return kind(value)


def _hb_endpoint(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not (isinstance(value, str) and _KV_EVENTS_ENDPOINT.match(value)):
        raise MalformedHeartbeat(
            f"{name} must be a ZMQ endpoint to connect to (tcp://host:port or ipc://path), got {value!r}"
        )
    return value


def check_step_calibration(value: Any, error: type[Exception]) -> float | None:
    """A reported step calibration: None when absent, else a number within
    [STEP_CALIBRATION_MIN, STEP_CALIBRATION_MAX]."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (STEP_CALIBRATION_MIN <= value <= STEP_CALIBRATION_MAX)
    ):
        raise error(
            f"{HeartbeatField.STEP_CALIBRATION} must be a number in [{STEP_CALIBRATION_MIN}, "
            f"{STEP_CALIBRATION_MAX}], got {value!r}"
        )
    return float(value)


def check_tpot_slo_ms(value: Any, error: type[Exception]) -> float | None:
    """A reported tightest TPOT SLO: None when absent, else a finite number of ms > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise error(f"{HeartbeatField.TPOT_SLO_MS} must be a number of milliseconds > 0, got {value!r}")
    return float(value)


_HEARTBEAT_DECODER = msgspec.json.Decoder(Heartbeat)


def parse_heartbeat(raw: bytes | str, node_id: str | None = None) -> Heartbeat:
    """Parse and check one heartbeat JSON; ``node_id`` (from the key) must match its node_id."""
    try:
        hb = _HEARTBEAT_DECODER.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        hb = _parse_heartbeat_checked(raw)  # names what is wrong (and takes what JSON allows beyond)
    else:
        if (
            not math.isfinite(hb.sent_at)
            or (hb.kv_usage is not None and not math.isfinite(hb.kv_usage))
            or (hb.tpot_slo_ms is not None and not math.isfinite(hb.tpot_slo_ms))
        ):
            hb = _parse_heartbeat_checked(raw)
        else:  # a check across fields, which the checked decoder makes too
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
    same verdict, with a message naming the field."""
    data = json_object(raw, MalformedHeartbeat)
    f = HeartbeatField
    missing = [name for name in f.ALL if name not in data]
    if missing:
        raise MalformedHeartbeat(f"missing fields {missing}")
    sent_at = data[f.SENT_AT]
    if not isinstance(sent_at, int | float) or isinstance(sent_at, bool) or not math.isfinite(sent_at):
        raise MalformedHeartbeat(f"sent_at must be a number, got {sent_at!r}")
    role = _hb_str(data, f.ROLE)
    if role not in tuple(Role):
        raise MalformedHeartbeat(f"role must be 'prefill' or 'decode', got {role!r}")
    hb = Heartbeat(
        node_id=_hb_str(data, f.NODE_ID),
        role=Role(role),
        url=_hb_str(data, f.URL),
        sidecar=_hb_str(data, f.SIDECAR),
        seq=_hb_int(data, f.SEQ),
        sent_at=float(sent_at),
        decode_tokens=_hb_int(data, f.DECODE_TOKENS),
        kv_tokens=_hb_int(data, f.KV_TOKENS),
        kv_capacity_tokens=_hb_int(data, f.KV_CAPACITY_TOKENS),
        queued_prefill_tokens=_hb_ints(data, f.QUEUED_PREFILL_TOKENS),
        scheduled_prefill_tokens=_hb_ints(data, f.SCHEDULED_PREFILL_TOKENS),
        max_step_tokens=_hb_int(data, f.MAX_STEP_TOKENS, minimum=1),
        model=_hb_str(data, f.MODEL),
        running_requests=_hb_optional(data, f.RUNNING_REQUESTS, int),
        waiting_requests=_hb_optional(data, f.WAITING_REQUESTS, int),
        kv_usage=_hb_optional(data, f.KV_USAGE, float),
        step_calibration=check_step_calibration(data.get(f.STEP_CALIBRATION), MalformedHeartbeat),
        pending_kv_pull_tokens=(
            _hb_ints(data, f.PENDING_KV_PULL_TOKENS) if data.get(f.PENDING_KV_PULL_TOKENS) is not None else None
        ),
        scheduled_prefill_computed_tokens=(
            _hb_ints(data, f.SCHEDULED_PREFILL_COMPUTED_TOKENS)
            if data.get(f.SCHEDULED_PREFILL_COMPUTED_TOKENS) is not None
            else None
        ),
        tpot_slo_ms=check_tpot_slo_ms(data.get(f.TPOT_SLO_MS), MalformedHeartbeat),
        queued_prefill_computed_tokens=(
            _hb_ints(data, f.QUEUED_PREFILL_COMPUTED_TOKENS)
            if data.get(f.QUEUED_PREFILL_COMPUTED_TOKENS) is not None
            else None
        ),
        kv_events_endpoint=_hb_endpoint(data, f.KV_EVENTS_ENDPOINT),
        kv_events_replay_endpoint=_hb_endpoint(data, f.KV_EVENTS_REPLAY_ENDPOINT),
        kv_events_topic=_hb_str(data, f.KV_EVENTS_TOPIC) if data.get(f.KV_EVENTS_TOPIC) is not None else None,
    )
    check_prefixes(hb, MalformedHeartbeat)
    return hb
