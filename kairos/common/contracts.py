"""Contracts shared by several parts of Kairos.

Nothing else defines these names: the profile file schema (read by the dispatcher, written by
the profiler, used by the simulator).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    """A node's role, as heartbeats, configs and command lines spell it."""

    PREFILL = "prefill"
    DECODE = "decode"


# ---------------------------------------------------------------------------------------------
# Latency profile file (JSON)
# ---------------------------------------------------------------------------------------------
PROFILE_SCHEMA_VERSION = 1

# Top-level keys of a profile file.
PROFILE_KEYS = ("schema_version", "name", "model", "hardware", "provenance", "models")

# The four models a profile carries, and for each linear model its features in the exact
# order the evaluator multiplies them. Times are in seconds, sizes in tokens.
PREFILL_STEP = "prefill_step"  # a prefill-only step on a prefill node
DECODE_STEP = "decode_step"  # a decode-only step: T0(B, K)
MIXED_INCREMENT = "mixed_increment"  # extra time of a step that also carries a prefill chunk
KV_TRANSFER = "kv_transfer"  # inter-node KV-cache transfer

LINEAR_MODEL_FEATURES: dict[str, tuple[str, ...]] = {
    # n = prefill tokens in the step, c = tokens already cached for the prefilling request(s)
    PREFILL_STEP: ("tokens", "tokens_over_knee", "tokens_x_cached"),
    # B = decode tokens in the step (one per running decode), K = KV tokens held by the node
    DECODE_STEP: ("decode_tokens", "kv_tokens"),
    # chi = total step tokens, p = chi - B prefill tokens, c = the deflected prefill's cached tokens
    MIXED_INCREMENT: (
        "prefill_tokens",
        "prefill_tokens_x_decode_tokens",
        "prefill_tokens_x_kv_tokens",
        "prefill_tokens_x_cached_tokens",
        "step_tokens_over_knee",
    ),
}

# Models whose features include a "*_over_knee" term carry the knee (tokens) beside them.
KNEE_MODELS = (PREFILL_STEP, MIXED_INCREMENT)

# ---------------------------------------------------------------------------------------------
# HTTP headers the dispatcher sets on a request it routes (read by the decode-node sidecar)
# ---------------------------------------------------------------------------------------------
HEADER_PREFIX = "x-kairos-"  # every client-sent header with this prefix is removed at the edge
H_REQUEST_ID = "x-request-id"  # one id for the whole request, on both sidecar hops
H_ROUTE = "x-kairos-route"  # "keep" or "deflect"
H_REASON = "x-kairos-reason"  # the Decision's reason (kairos.core.decision.Reason value)
H_DECODE_NODE = "x-kairos-decode-node"  # node id of the decode node chosen
H_PREFILL_HOST = "x-kairos-prefill-host"  # keep: host:port of the prefill node's vLLM server
# deflect: prompt tokens per step, comma-separated, e.g. "1020,508,508,252"
H_CHUNK_SCHEDULE = "x-kairos-chunk-schedule"
H_STEP_BUDGET_MS = "x-kairos-step-budget-ms"  # deflect: beta x tau the node enforces per chunk step
H_PRED_TTFT_PREFILL_MS = "x-kairos-predicted-ttft-prefill-ms"
H_PRED_TTFT_DECODE_MS = "x-kairos-predicted-ttft-decode-ms"  # absent when not computed
H_PROMPT_TOKENS = "x-kairos-prompt-tokens"  # the dispatcher's prompt token count

# The sidecar echoes these on the response, so a client or an operator can see which path a
# request took (curl -i shows them).
ECHOED_RESPONSE_HEADERS = (
    H_ROUTE,
    H_REASON,
    H_DECODE_NODE,
    H_CHUNK_SCHEDULE,
    H_PROMPT_TOKENS,
    H_PRED_TTFT_PREFILL_MS,
    H_PRED_TTFT_DECODE_MS,
)

# Envoy's override_host load balancing reads the upstream from this dynamic metadata.
ENVOY_LB_NAMESPACE = "envoy.lb"
ENVOY_DESTINATION_KEY = "x-gateway-destination-endpoint"  # value: "primary,fallback" host:port list

# ---------------------------------------------------------------------------------------------
# vLLM request extensions
# ---------------------------------------------------------------------------------------------
# The sidecar passes a deflected request's schedule to the decode node's vLLM in the body's
# ``vllm_xargs`` (vLLM copies it into sampling_params.extra_args, where the scheduler plugin
# reads it). Chunks are prompt tokens per step; the last size repeats if the prompt outlasts
# the schedule. At most one scheduled prefill advances per step on a node.
XARG_CHUNK_SCHEDULE = "kairos_chunk_schedule"  # list[int]
XARG_STEP_BUDGET_MS = "kairos_step_budget_ms"  # float, optional: enforce per-step budget
KV_TRANSFER_PARAMS = "kv_transfer_params"  # vLLM's P/D hand-off field, request and response

# ---------------------------------------------------------------------------------------------
# Redis: heartbeats and deflection reservations
# ---------------------------------------------------------------------------------------------
REDIS_NODE_KEY = "kairos:node:{node_id}"  # JSON heartbeat, SET with PX expiry (dead node vanishes)
REDIS_NODE_PATTERN = "kairos:node:*"
REDIS_HEARTBEAT_CHANNEL = "kairos:heartbeats"  # the same JSON is PUBLISHed here on every beat
# A dispatcher that deflects to a node first takes this key with SET NX PX; a second dispatcher
# replica then sees the node as taken until the key expires (about one heartbeat period).
REDIS_RESERVATION_KEY = "kairos:reserve:{node_id}"

# After a request's first token the decode-node sidecar (when given a Redis URL) XADDs one entry
# here, fields in TtftFeedbackField; every dispatcher XREADs it into its live model-error metrics.
REDIS_TTFT_FEEDBACK_STREAM = "kairos:ttft-feedback"
TTFT_FEEDBACK_MAXLEN = 10_000  # XADD MAXLEN ~ this: the stream is a recent window, not a log

HEARTBEAT_PERIOD_S = 0.1  # Delta_h
HEARTBEAT_TTL_S = 0.5  # key expiry: five missed beats and the node is gone


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
    OPTIONAL = (RUNNING_REQUESTS, WAITING_REQUESTS, KV_USAGE)

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


class TtftFeedbackField:
    """Fields of one :data:`REDIS_TTFT_FEEDBACK_STREAM` entry (all strings on the wire)."""

    REQUEST_ID = "request_id"  # the x-request-id both hops carried
    PATH = "path"  # "keep" or "deflect": the path the dispatcher chose
    NODE = "node"  # the decode node that served it
    PREDICTED_MS = "predicted_ms"  # the dispatcher's TTFT prediction for that path, ms
    OBSERVED_MS = "observed_ms"  # arrival at the sidecar to the first body byte relayed, ms

    ALL = (REQUEST_ID, PATH, NODE, PREDICTED_MS, OBSERVED_MS)


# ---------------------------------------------------------------------------------------------
# The heartbeat: one encoder (the node's publisher), one decoder (every dispatcher)
# ---------------------------------------------------------------------------------------------
class MalformedHeartbeat(ValueError):
    """A heartbeat value that does not follow the contract."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One heartbeat (every :class:`HeartbeatField`, by the same names)."""

    node_id: str
    role: Role
    url: str  # host:port of the node's vLLM server
    sidecar: str  # host:port of the decode sidecar ("" on prefill nodes)
    seq: int
    sent_at: float  # publisher's unix time (informational: ages use the receiver's clock)
    decode_tokens: int
    kv_tokens: int
    kv_capacity_tokens: int
    queued_prefill_tokens: tuple[int, ...]
    scheduled_prefill_tokens: tuple[int, ...]
    max_step_tokens: int
    model: str
    running_requests: int | None = None
    waiting_requests: int | None = None
    kv_usage: float | None = None


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
    }
    beat |= {k: v for k, v in optional.items() if v is not None}
    return json.dumps(beat, separators=(",", ":"))


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


def parse_heartbeat(raw: bytes | str, node_id: str | None = None) -> Heartbeat:
    """Parse and check one heartbeat JSON; ``node_id`` (from the key) must match its node_id."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedHeartbeat(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedHeartbeat(f"expected a JSON object, got {type(data).__name__}")
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
    )
    if node_id is not None and hb.node_id != node_id:
        raise MalformedHeartbeat(f"node_id {hb.node_id!r} does not match its key's {node_id!r}")
    if not hb.url:
        raise MalformedHeartbeat("url is empty")
    if hb.role is Role.DECODE and not hb.sidecar:
        raise MalformedHeartbeat("a decode node needs a sidecar address (the dispatcher routes to it)")
    return hb
