"""Contracts shared by several parts of Kairos.

Nothing else defines these names: the profile file schema (read by the dispatcher, written by
the profiler, used by the simulator), the dispatcher's headers, the Redis keys, and the node-side
wire formats (heartbeats, the engine state at :data:`STATE_PATH`, step records at
:data:`STEPS_PATH`, chunk schedules in headers and ``vllm_xargs``), each with its one encoder and
its one decoder, which both sides call.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import msgspec

from kairos.common.errors import KairosError


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
# The public API: what the gateway's port serves (Envoy routes exactly these paths, the
# dispatcher checks the methods, a decode sidecar relays the non-inference ones to its vLLM);
# any other path is a JSON 404 from Envoy. Node- and sidecar-internal endpoints (/metrics,
# /kairos/state, /kairos/steps, the KV pull, /kairos/metrics) are reachable on their own ports only.
# ---------------------------------------------------------------------------------------------
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")  # POST: routed by Algorithm 1
PUBLIC_ENDPOINTS: Mapping[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),  # the decode sidecar's: 200 when its local vLLM is
    "/tokenize": ("POST",),  # vLLM's; `vllm bench serve` calls it first
    "/detokenize": ("POST",),
    "/version": ("GET",),
}

# ---------------------------------------------------------------------------------------------
# HTTP headers the dispatcher sets on a request it routes (read by the decode-node sidecar)
# ---------------------------------------------------------------------------------------------
# A client's routing header (ROUTING_HEADERS, below) never reaches a sidecar: a request carrying
# one takes the gateway's headers route, where the dispatcher removes every header with this
# prefix that it does not set itself.
HEADER_PREFIX = "x-kairos-"
H_REQUEST_ID = "x-request-id"  # one id for the whole request, on both sidecar hops
H_ROUTE = "x-kairos-route"  # "keep" or "deflect" (the decision's route), or ROUTE_FANOUT
# A batch (several prompts in one /v1/completions body): the sidecar sends each prompt back
# through the gateway, where each gets a decision of its own, and merges the answers as vLLM.
ROUTE_FANOUT = "fanout"
H_REASON = "x-kairos-reason"  # the Decision's reason (kairos.core.decision.Reason value)
H_DECODE_NODE = "x-kairos-decode-node"  # node id of the decode node chosen
H_PREFILL_HOST = "x-kairos-prefill-host"  # keep: host:port of the prefill node's vLLM server
# deflect: prompt tokens per step, comma-separated, e.g. "1020,508,508,252"
H_CHUNK_SCHEDULE = "x-kairos-chunk-schedule"
# deflect: beta x tau the node enforces per chunk step; keep: the same, for a local prefill
# should the prefill node fail (the sidecar sends the prompt to its vLLM with this budget)
H_STEP_BUDGET_MS = "x-kairos-step-budget-ms"
H_PRED_TTFT_PREFILL_MS = "x-kairos-predicted-ttft-prefill-ms"
H_PRED_TTFT_DECODE_MS = "x-kairos-predicted-ttft-decode-ms"  # absent when not computed
H_PROMPT_TOKENS = "x-kairos-prompt-tokens"  # the dispatcher's prompt token count
# The prompt tokens the dispatcher predicted cached on the node that prefills the request (the
# decode node on deflect, the prefill node on keep), from the nodes' KV events; absent when none.
# Informational: a deflection's schedule covers the rest, so it sums to prompt - cached.
H_CACHED_TOKENS = "x-kairos-cached-tokens"
# The SLOs the request was decided with (kairos.core.slo): its own, or the cluster's defaults.
# TTFT bounds a deflection (Eq. 7); the sidecar passes TPOT to the decode node's vLLM
# (XARG_TPOT_SLO_MS), whose heartbeat reports the tightest among its requests (HeartbeatField.TPOT_SLO_MS).
H_DECIDED_TTFT_SLO_MS = "x-kairos-slo-ttft-ms"
H_DECIDED_TPOT_SLO_MS = "x-kairos-slo-tpot-ms"
H_SLO_CLASS = "x-kairos-slo-class"  # the class its SLOs fall in (kairos.core.slo.classify)

# A client's own SLOs, in milliseconds (llm-d's names); absent: the cluster's defaults. A request
# carrying one takes Envoy's headers route (the dispatcher reads them from its head).
H_SLO_TTFT_MS = "x-slo-ttft-ms"
H_SLO_TPOT_MS = "x-slo-tpot-ms"
SLO_HEADERS = (H_SLO_TTFT_MS, H_SLO_TPOT_MS)

# The sidecar echoes these on the response, so a client or an operator can see which path a
# request took (curl -i shows them).
ECHOED_RESPONSE_HEADERS = (
    H_ROUTE,
    H_REASON,
    H_DECODE_NODE,
    H_CHUNK_SCHEDULE,
    H_PROMPT_TOKENS,
    H_CACHED_TOKENS,
    H_PRED_TTFT_PREFILL_MS,
    H_PRED_TTFT_DECODE_MS,
    H_DECIDED_TTFT_SLO_MS,
    H_DECIDED_TPOT_SLO_MS,
    H_SLO_CLASS,
)

# Every routing header: a client request carrying any of them is never on Envoy's one-message
# route (below), so the dispatcher sees its headers and removes them.
ROUTING_HEADERS = (
    H_ROUTE,
    H_REASON,
    H_DECODE_NODE,
    H_PREFILL_HOST,
    H_CHUNK_SCHEDULE,
    H_STEP_BUDGET_MS,
    H_PRED_TTFT_PREFILL_MS,
    H_PRED_TTFT_DECODE_MS,
    H_PROMPT_TOKENS,
    H_CACHED_TOKENS,
    H_DECIDED_TTFT_SLO_MS,
    H_DECIDED_TPOT_SLO_MS,
    H_SLO_CLASS,
)

# Envoy's one-message route (envoy/envoy.yaml.j2): a plain inference request reaches the
# dispatcher as its body alone, with these facts of its head as ext_proc attributes (Envoy's
# attribute expressions, each the key of its own value, under the filter's name).
EXT_PROC_ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
ATTR_METHOD = "request.method"
ATTR_PATH = "request.path"  # with its query string, as :path
ATTR_REQUEST_ID = "request.id"  # x-request-id, as the headers message would carry it
ATTR_HEADER_COUNT = "size(request.headers)"  # pseudo-headers included, as Envoy's limits count
ATTR_TOTAL_BYTES = "request.total_size"  # the head's names and values, plus the body
ATTR_BODY_BYTES = "request.size"
HEAD_ATTRIBUTES = (ATTR_METHOD, ATTR_PATH, ATTR_REQUEST_ID, ATTR_HEADER_COUNT, ATTR_TOTAL_BYTES, ATTR_BODY_BYTES)

# Envoy's override_host load balancing reads the upstream from this dynamic metadata.
ENVOY_LB_NAMESPACE = "envoy.lb"
# The dispatcher's answer carries the headers it sets as dynamic metadata in this namespace, one
# key per header name; the gateway's routes add each as a request header (envoy.yaml.j2).
ROUTING_METADATA_NAMESPACE = "kairos.headers"
ENVOY_DESTINATION_KEY = "x-gateway-destination-endpoint"  # value: "primary,fallback" host:port list
# The grpc.health.v1 service name Envoy's health checks ask the dispatcher about: the ext_proc
# service's full proto name (SERVING while it runs, NOT_SERVING once it stops).
EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

# ---------------------------------------------------------------------------------------------
# vLLM request extensions
# ---------------------------------------------------------------------------------------------
# The sidecar passes a deflected request's schedule to the decode node's vLLM in the body's
# ``vllm_xargs`` (vLLM copies it into sampling_params.extra_args, where the scheduler plugin
# reads it). Chunks are prompt tokens per step; the last size repeats if the prompt outlasts
# the schedule. At most one scheduled prefill advances per step on a node.
VLLM_XARGS = "vllm_xargs"  # the body's object of extension arguments
XARG_PREFIX = "kairos_"  # every Kairos argument in it: the dispatcher's to set, never a client's
XARG_CHUNK_SCHEDULE = "kairos_chunk_schedule"  # list[int]
XARG_STEP_BUDGET_MS = "kairos_step_budget_ms"  # float, optional: enforce per-step budget
# float, optional, any request: its TPOT SLO in ms (H_DECIDED_TPOT_SLO_MS). The node's step guard
# holds a chunk's steps to the tightest TPOT among its running decodes, and its heartbeat reports
# the tightest among its requests (HeartbeatField.TPOT_SLO_MS). Absent: the cluster default.
XARG_TPOT_SLO_MS = "kairos_tpot_slo_ms"
SCHEDULE_PARAM = f"{VLLM_XARGS}.{XARG_CHUNK_SCHEDULE}"  # as error messages name them
BUDGET_PARAM = f"{VLLM_XARGS}.{XARG_STEP_BUDGET_MS}"
MAX_SCHEDULE_CHUNKS = 4096  # the plugin's cap; a 32K prompt in 128-token chunks needs 256
KV_TRANSFER_PARAMS = "kv_transfer_params"  # vLLM's P/D hand-off field, request and response

# ---------------------------------------------------------------------------------------------
# Redis: heartbeats and deflection reservations
# ---------------------------------------------------------------------------------------------
REDIS_NODE_KEY = "kairos:node:{node_id}"  # JSON heartbeat, SET with PX expiry (dead node vanishes)
REDIS_NODE_PATTERN = "kairos:node:*"
REDIS_HEARTBEAT_CHANNEL = "kairos:heartbeats"  # the same JSON is PUBLISHed here on every beat
# A dispatcher that deflects to a node first promises it here: a sorted set of the node's recent
# deflections, which the promise script alone writes (``kairos.extproc.reservations``).
REDIS_RESERVATION_KEY = "kairos:reserve:{node_id}"
# The promise script PUBLISHes each promise it grants here, so that the other dispatcher replicas
# count it before their next decision rather than after a refused promise of their own.
REDIS_PROMISE_CHANNEL = "kairos:promises"
# No dispatcher holds a reservation longer than this: a key without an expiry, or with a longer
# one, was not set by a dispatcher, and the next dispatcher that wants the node takes it over.
RESERVATION_MAX_TTL_S = 10.0

# After a streamed request's first token the decode-node sidecar (when given a Redis URL) XADDs one
# entry here, fields in TtftFeedbackField; every dispatcher XREADs it into its live model-error
# metrics. A non-streamed request gets no entry: its one JSON body leaves the node after the last
# token, so no one outside the node sees its first token (kairos.nodeagent.sidecar says more).
REDIS_TTFT_FEEDBACK_STREAM = "kairos:ttft-feedback"
TTFT_FEEDBACK_MAXLEN = 10_000  # XADD MAXLEN ~ this: the stream is a recent window, not a log
# A reader ignores (and counts) entries outside these bounds: TTFTs above 10 minutes, or an
# observed/predicted ratio beyond 1000x either way, are junk, never a measurement.
TTFT_FEEDBACK_MAX_MS = 600_000.0
TTFT_FEEDBACK_MAX_RATIO = 1000.0
TTFT_FEEDBACK_MAX_ID_CHARS = 256  # request_id and node

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


class TtftFeedbackField:
    """Fields of one :data:`REDIS_TTFT_FEEDBACK_STREAM` entry (all strings on the wire)."""

    REQUEST_ID = "request_id"  # the x-request-id both hops carried
    PATH = "path"  # "keep" or "deflect": the path the dispatcher chose
    NODE = "node"  # the decode node that served it
    PREDICTED_MS = "predicted_ms"  # the dispatcher's TTFT prediction for that path, ms
    OBSERVED_MS = "observed_ms"  # arrival at the sidecar to the first token relayed, ms
    # What observed_ms timed: always TTFT_FEEDBACK_FIRST_TOKEN. Readers refuse an entry without it:
    # sidecars before it also sent the first body byte of non-streamed responses, which comes
    # after the whole generation, and nothing else in such an entry tells it from a TTFT.
    MEASURED = "measured"

    ALL = (REQUEST_ID, PATH, NODE, PREDICTED_MS, OBSERVED_MS, MEASURED)


TTFT_FEEDBACK_FIRST_TOKEN = "first_token"  # TtftFeedbackField.MEASURED: the first event of a stream


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
        f.SCHEDULED_PREFILL_COMPUTED_TOKENS: _list_or_none(hb.scheduled_prefill_computed_tokens),
        f.TPOT_SLO_MS: hb.tpot_slo_ms,
        f.QUEUED_PREFILL_COMPUTED_TOKENS: _list_or_none(hb.queued_prefill_computed_tokens),
        f.KV_EVENTS_ENDPOINT: hb.kv_events_endpoint,
        f.KV_EVENTS_REPLAY_ENDPOINT: hb.kv_events_replay_endpoint,
        f.KV_EVENTS_TOPIC: hb.kv_events_topic,
    }
    beat |= {k: v for k, v in optional.items() if v is not None}
    return json.dumps(beat, separators=(",", ":"))


def _list_or_none(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


def _check_prefixes(values: Any, error: type[Exception], prefix: str = "") -> None:
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


def _step_calibration(value: Any, error: type[Exception]) -> float | None:
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


def _tpot_slo_ms(value: Any, error: type[Exception]) -> float | None:
    """A reported tightest TPOT SLO: None when absent, else a finite number of ms > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise error(f"{HeartbeatField.TPOT_SLO_MS} must be a number of milliseconds > 0, got {value!r}")
    return float(value)


def _json_object(raw: bytes | str, error: type[Exception], prefix: str = "") -> dict[str, Any]:
    """``raw`` decoded as one JSON object, else ``error`` saying what it was instead (the one
    first step of every decoder here)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{prefix}not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise error(f"{prefix}expected a JSON object, got {type(data).__name__}")
    return data


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
            _check_prefixes(hb, MalformedHeartbeat)
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
    data = _json_object(raw, MalformedHeartbeat)
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
        step_calibration=_step_calibration(data.get(f.STEP_CALIBRATION), MalformedHeartbeat),
        pending_kv_pull_tokens=(
            _hb_ints(data, f.PENDING_KV_PULL_TOKENS) if data.get(f.PENDING_KV_PULL_TOKENS) is not None else None
        ),
        scheduled_prefill_computed_tokens=(
            _hb_ints(data, f.SCHEDULED_PREFILL_COMPUTED_TOKENS)
            if data.get(f.SCHEDULED_PREFILL_COMPUTED_TOKENS) is not None
            else None
        ),
        tpot_slo_ms=_tpot_slo_ms(data.get(f.TPOT_SLO_MS), MalformedHeartbeat),
        queued_prefill_computed_tokens=(
            _hb_ints(data, f.QUEUED_PREFILL_COMPUTED_TOKENS)
            if data.get(f.QUEUED_PREFILL_COMPUTED_TOKENS) is not None
            else None
        ),
        kv_events_endpoint=_hb_endpoint(data, f.KV_EVENTS_ENDPOINT),
        kv_events_replay_endpoint=_hb_endpoint(data, f.KV_EVENTS_REPLAY_ENDPOINT),
        kv_events_topic=_hb_str(data, f.KV_EVENTS_TOPIC) if data.get(f.KV_EVENTS_TOPIC) is not None else None,
    )
    _check_prefixes(hb, MalformedHeartbeat)
    return hb


# ---------------------------------------------------------------------------------------------
# A deflected prefill's chunk schedule and step budget. The dispatcher encodes the headers, the
# sidecar decodes them and builds the vllm_xargs, the vLLM plugin (and the emulated node, so it
# answers as vLLM does) decodes those.
# ---------------------------------------------------------------------------------------------
class MalformedSchedule(ValueError):
    """A malformed chunk schedule or step budget. A ValueError: raised in the validator plugin's
    ``validate_params``, vLLM answers it with an HTTP 400."""


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Prompt tokens per step for one deflected prefill; the last size repeats."""

    sizes: tuple[int, ...]
    step_budget_s: float | None = None  # longest step this prefill may cause on the node

    def cap(self, step: int) -> int:
        """Most prompt tokens the request may take in its ``step``-th chunk (0-based)."""
        return self.sizes[min(step, len(self.sizes) - 1)]


def _check_chunk_count(name: str, count: int) -> None:
    if count > MAX_SCHEDULE_CHUNKS:
        raise MalformedSchedule(f"{name} has {count} chunks, more than {MAX_SCHEDULE_CHUNKS}")


def encode_chunk_schedule(sizes: Iterable[int]) -> str:
    """The :data:`H_CHUNK_SCHEDULE` value: prompt tokens per step, comma-separated."""
    return ",".join(str(x) for x in sizes)


def parse_chunk_schedule_header(value: str) -> tuple[int, ...]:
    """Decode :data:`H_CHUNK_SCHEDULE`; :class:`MalformedSchedule` unless it is 1 to
    :data:`MAX_SCHEDULE_CHUNKS` positive integers."""
    try:
        sizes = tuple(int(x) for x in value.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise MalformedSchedule(f"{H_CHUNK_SCHEDULE}={value!r} is not a list of positive integers")
    _check_chunk_count(H_CHUNK_SCHEDULE, len(sizes))
    return sizes


def encode_step_budget_ms(budget_ms: float) -> str:
    """The :data:`H_STEP_BUDGET_MS` value (microsecond resolution)."""
    return f"{budget_ms:.3f}"


def parse_step_budget_ms(value: str) -> float:
    """Decode :data:`H_STEP_BUDGET_MS` (milliseconds, as ``vllm_xargs`` carries it)."""
    try:
        budget = float(value)
    except ValueError:
        budget = math.nan
    if not 0 < budget < math.inf:
        raise MalformedSchedule(f"{H_STEP_BUDGET_MS}={value!r} is not a positive number")
    return budget


def parse_tpot_slo_ms(value: str) -> float:
    """Decode :data:`H_DECIDED_TPOT_SLO_MS` (milliseconds, as :data:`XARG_TPOT_SLO_MS` carries it)."""
    try:
        tpot = float(value)
    except ValueError:
        tpot = math.nan
    if not 0 < tpot < math.inf:
        raise MalformedSchedule(f"{H_DECIDED_TPOT_SLO_MS}={value!r} is not a positive number")
    return tpot


def schedule_xargs(sizes: Sequence[int], step_budget_ms: float | None = None) -> dict[str, Any]:
    """The :data:`VLLM_XARGS` entries that carry a schedule (merge them into the body's own)."""
    xargs: dict[str, Any] = {XARG_CHUNK_SCHEDULE: list(sizes)}
    if step_budget_ms is not None:
        xargs[XARG_STEP_BUDGET_MS] = step_budget_ms
    return xargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_schedule_xargs(extra_args: Mapping[str, Any] | None) -> ChunkPlan | None:
    """The request's :class:`ChunkPlan` from its ``vllm_xargs`` (vLLM's
    ``sampling_params.extra_args``), or None when it carries no schedule.

    Raises :class:`MalformedSchedule` for a schedule that is not 1 to :data:`MAX_SCHEDULE_CHUNKS`
    positive integers, a budget that is not a positive number of milliseconds, or a budget
    without a schedule. A chunk over the node's per-step token budget is not an error: the
    engine caps it (vLLM's validator cannot see the engine's limits).
    """
    if not extra_args:
        return None
    raw, budget = extra_args.get(XARG_CHUNK_SCHEDULE), extra_args.get(XARG_STEP_BUDGET_MS)
    if raw is None:
        if budget is not None:
            raise MalformedSchedule(f"{BUDGET_PARAM} needs {SCHEDULE_PARAM}")
        return None
    if not isinstance(raw, list | tuple) or not raw or not all(_is_int(x) and x > 0 for x in raw):
        raise MalformedSchedule(f"{SCHEDULE_PARAM} must be a non-empty array of positive integers, got {raw!r}")
    _check_chunk_count(SCHEDULE_PARAM, len(raw))
    budget_s: float | None = None
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < math.inf:
            raise MalformedSchedule(f"{BUDGET_PARAM} must be a positive number of milliseconds, got {budget!r}")
        budget_s = float(budget) / 1e3
    return ChunkPlan(tuple(raw), budget_s)


TPOT_PARAM = f"{VLLM_XARGS}.{XARG_TPOT_SLO_MS}"


def parse_tpot_xarg(extra_args: Mapping[str, Any] | None) -> float | None:
    """The request's TPOT SLO in seconds from its ``vllm_xargs`` (None: it carries none). Raises
    :class:`MalformedSchedule` (vLLM's 400) for a value that is not a positive number of ms."""
    if not extra_args:
        return None
    raw = extra_args.get(XARG_TPOT_SLO_MS)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 < raw < math.inf:
        raise MalformedSchedule(f"{TPOT_PARAM} must be a positive number of milliseconds, got {raw!r}")
    return float(raw) / 1e3


# ---------------------------------------------------------------------------------------------
# Metrics the node agents export: the sidecar's path, and step-budget overruns (a node's steps that
# broke the budget a deflected chunk carried), counted by the emulated node (its /metrics) and the
# vLLM plugin (its state server's /metrics) alike.
# ---------------------------------------------------------------------------------------------
SIDECAR_METRICS_PATH = "/kairos/metrics"  # a decode sidecar's Prometheus metrics (kairos_sidecar_*)
# The node agent's probe of its decode sidecar, every heartbeat: the sidecar's own event loop
# answers 204, touching nothing else (its metrics page costs ~1 ms to render, ten times a second).
SIDECAR_PROBE_PATH = "/kairos/probe"
STEP_BUDGET_OVERRUNS_METRIC = "kairos_node_step_budget_overruns"  # a counter: exported with _total
STEP_BUDGET_OVERRUNS_HELP = (
    "Steps with running decodes that took longer than the step budget of a deflected chunk they "
    "carried (the decodes' TBT went over what the dispatcher planned for)"
)


def overran_step_budget(
    decode_tokens: int, budgets_s: Iterable[float | None], duration_s: float, step_calibration: float = 1.0
) -> bool:
    """Whether one step counts as an overrun: decodes ran in it (the budget protects their TBT;
    with none running it does not apply) and it lasted longer than the tightest budget of its
    chunks times the node's step calibration (a budget is predicted time, beta x tau / the
    calibration the dispatcher planned with: a step of the planned length is allowed to run that
    much slower than its prediction)."""
    budgets = [b for b in budgets_s if b is not None]
    return decode_tokens > 0 and bool(budgets) and duration_s > min(budgets) * step_calibration


# ---------------------------------------------------------------------------------------------
# The engine state: what a node's vLLM (its Kairos scheduler plugin) or emulated vLLM serves at
# STATE_PATH for its heartbeat publisher. One encoder (both servers), one decoder (the publisher).
# ---------------------------------------------------------------------------------------------
STATE_PATH = "/kairos/state"


class EngineStateField:
    """Fields of the engine-state JSON object: the heartbeat's load fields, by the same names."""

    DECODE_TOKENS = HeartbeatField.DECODE_TOKENS  # B: running decodes, one token each per step
    KV_TOKENS = HeartbeatField.KV_TOKENS  # K: KV-cache tokens in use
    KV_CAPACITY_TOKENS = HeartbeatField.KV_CAPACITY_TOKENS
    QUEUED_PREFILL_TOKENS = HeartbeatField.QUEUED_PREFILL_TOKENS  # list[int], FIFO
    SCHEDULED_PREFILL_TOKENS = HeartbeatField.SCHEDULED_PREFILL_TOKENS  # list[int], deflected prefills
    MAX_STEP_TOKENS = HeartbeatField.MAX_STEP_TOKENS  # max_num_batched_tokens
    MODEL = HeartbeatField.MODEL
    # Optional: real vLLM reports these (the Kairos scheduler plugin), as its /metrics defines them.
    RUNNING_REQUESTS = HeartbeatField.RUNNING_REQUESTS
    WAITING_REQUESTS = HeartbeatField.WAITING_REQUESTS
    KV_USAGE = HeartbeatField.KV_USAGE
    STEP_CALIBRATION = HeartbeatField.STEP_CALIBRATION  # the node's, when it measures its steps
    PENDING_KV_PULL_TOKENS = HeartbeatField.PENDING_KV_PULL_TOKENS  # list[int], decode nodes' KV pulls
    # list[int], one per scheduled (queued) prefill: its prompt tokens computed already
    SCHEDULED_PREFILL_COMPUTED_TOKENS = HeartbeatField.SCHEDULED_PREFILL_COMPUTED_TOKENS
    TPOT_SLO_MS = HeartbeatField.TPOT_SLO_MS  # the tightest TPOT SLO among its requests in flight
    QUEUED_PREFILL_COMPUTED_TOKENS = HeartbeatField.QUEUED_PREFILL_COMPUTED_TOKENS
    AS_OF = "as_of"  # float unix seconds the snapshot was taken (informational)

    REQUIRED = (
        DECODE_TOKENS,
        KV_TOKENS,
        KV_CAPACITY_TOKENS,
        QUEUED_PREFILL_TOKENS,
        SCHEDULED_PREFILL_TOKENS,
        MAX_STEP_TOKENS,
        MODEL,
    )
    OPTIONAL = (
        RUNNING_REQUESTS,
        WAITING_REQUESTS,
        KV_USAGE,
        STEP_CALIBRATION,
        PENDING_KV_PULL_TOKENS,
        SCHEDULED_PREFILL_COMPUTED_TOKENS,
        TPOT_SLO_MS,
        QUEUED_PREFILL_COMPUTED_TOKENS,
        AS_OF,
    )


class EngineStateError(KairosError):
    """The engine's state could not be read or is malformed."""

    code = "engine_state_unavailable"


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine reports each beat (every :class:`EngineStateField`, by the same names)."""

    decode_tokens: int
    kv_tokens: int
    kv_capacity_tokens: int
    queued_prefill_tokens: tuple[int, ...]  # remaining prefill tokens per queued/prefilling request, FIFO
    scheduled_prefill_tokens: tuple[int, ...]  # remaining tokens of deflected (scheduled) prefills
    max_step_tokens: int
    model: str
    running_requests: int | None = None  # None where the engine does not say
    waiting_requests: int | None = None
    kv_usage: float | None = None
    step_calibration: float | None = None  # actual / predicted step time, its upper quantile
    pending_kv_pull_tokens: tuple[int, ...] | None = None  # KV transfers the node has yet to finish, FIFO
    # Per scheduled prefill, in the same order: its prompt tokens computed already (None: not reported)
    scheduled_prefill_computed_tokens: tuple[int, ...] | None = None
    tpot_slo_ms: float | None = None  # the tightest TPOT SLO among its requests in flight (None: none)
    queued_prefill_computed_tokens: tuple[int, ...] | None = None  # likewise, per queued prefill
    as_of: float | None = None

    def __post_init__(self) -> None:
        for name in ("decode_tokens", "kv_tokens", "kv_capacity_tokens", "max_step_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise EngineStateError(f"engine state: {name} must be an int >= 0, got {value!r}")
        if self.max_step_tokens < 1:
            raise EngineStateError(f"engine state: max_step_tokens must be >= 1, got {self.max_step_tokens}")
        for name in ("queued_prefill_tokens", "scheduled_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(_is_int(x) and x >= 0 for x in value):
                raise EngineStateError(f"engine state: {name} must be a tuple of ints >= 0, got {value!r}")
        if not isinstance(self.model, str):
            raise EngineStateError(f"engine state: model must be a string, got {self.model!r}")
        for name in ("running_requests", "waiting_requests"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise EngineStateError(f"engine state: {name} must be an int >= 0, got {value!r}")
        for name in ("pending_kv_pull_tokens", "scheduled_prefill_computed_tokens", "queued_prefill_computed_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, tuple) or not all(_is_int(x) and x >= 0 for x in value)):
                raise EngineStateError(f"engine state: {name} must be a tuple of ints >= 0, got {value!r}")
        _check_prefixes(self, EngineStateError, "engine state: ")
        usage = self.kv_usage
        if usage is not None and (isinstance(usage, bool) or not isinstance(usage, int | float) or not 0 <= usage <= 1):
            raise EngineStateError(f"engine state: kv_usage must be a number in [0, 1], got {usage!r}")
        _step_calibration(self.step_calibration, EngineStateError)
        _tpot_slo_ms(self.tpot_slo_ms, EngineStateError)
        as_of = self.as_of
        if as_of is not None and (
            isinstance(as_of, bool) or not isinstance(as_of, int | float) or not math.isfinite(as_of)
        ):
            raise EngineStateError(f"engine state: as_of must be a finite number, got {as_of!r}")


def encode_engine_state(state: EngineState) -> str:
    """The state's compact JSON, as served at :data:`STATE_PATH`; unset optional fields left out."""
    f = EngineStateField
    out: dict[str, Any] = {
        f.DECODE_TOKENS: state.decode_tokens,
        f.KV_TOKENS: state.kv_tokens,
        f.KV_CAPACITY_TOKENS: state.kv_capacity_tokens,
        f.QUEUED_PREFILL_TOKENS: list(state.queued_prefill_tokens),
        f.SCHEDULED_PREFILL_TOKENS: list(state.scheduled_prefill_tokens),
        f.MAX_STEP_TOKENS: state.max_step_tokens,
        f.MODEL: state.model,
    }
    optional = {
        f.RUNNING_REQUESTS: state.running_requests,
        f.WAITING_REQUESTS: state.waiting_requests,
        f.KV_USAGE: state.kv_usage,
        f.STEP_CALIBRATION: state.step_calibration,
        f.PENDING_KV_PULL_TOKENS: None if state.pending_kv_pull_tokens is None else list(state.pending_kv_pull_tokens),
        f.SCHEDULED_PREFILL_COMPUTED_TOKENS: _list_or_none(state.scheduled_prefill_computed_tokens),
        f.TPOT_SLO_MS: state.tpot_slo_ms,
        f.QUEUED_PREFILL_COMPUTED_TOKENS: _list_or_none(state.queued_prefill_computed_tokens),
        f.AS_OF: state.as_of,
    }
    out |= {k: v for k, v in optional.items() if v is not None}
    return json.dumps(out, separators=(",", ":"))


def parse_engine_state(raw: bytes | str) -> EngineState:
    """Parse and check one engine-state JSON (lists become tuples; unknown keys are ignored)."""
    data = _json_object(raw, EngineStateError, "engine state: ")
    f = EngineStateField
    missing = [n for n in f.REQUIRED if n not in data]
    if missing:
        raise EngineStateError(f"engine state: missing fields {missing}")
    values = {n: data[n] for n in f.REQUIRED}
    for name in (f.QUEUED_PREFILL_TOKENS, f.SCHEDULED_PREFILL_TOKENS):
        if not isinstance(values[name], list):
            raise EngineStateError(f"engine state: {name} must be a list, got {values[name]!r}")
        values[name] = tuple(values[name])
    values |= {n: data[n] for n in f.OPTIONAL if data.get(n) is not None}
    for name in (f.PENDING_KV_PULL_TOKENS, f.SCHEDULED_PREFILL_COMPUTED_TOKENS, f.QUEUED_PREFILL_COMPUTED_TOKENS):
        listed = values.get(name)
        if listed is not None:
            if not isinstance(listed, list):
                raise EngineStateError(f"engine state: {name} must be a list, got {listed!r}")
            values[name] = tuple(listed)
    return EngineState(**values)


# ---------------------------------------------------------------------------------------------
# Step records: one JSON object per engine step, written by the vLLM step recorder (JSONL and
# STEPS_PATH), the emulated node (STEPS_PATH) and the profiler's virtual engine; read by the
# profiler. Times are model seconds (wall seconds on real vLLM).
# ---------------------------------------------------------------------------------------------
STEPS_PATH = "/kairos/steps"  # GET ?since=N: a page of the node's newest step records
STEPS_SINCE = "since"  # the query parameter: the first step index wanted


class StepField:
    """Fields of one step record (the first six required; extra keys are allowed)."""

    INDEX = "index"  # int, the engine's step counter (per node)
    START = "start"  # float, model seconds when the step started
    DURATION = "duration"  # float > 0, model seconds the step took
    DECODE_TOKENS = "decode_tokens"  # B: running decodes in the step, one token each
    KV_TOKENS = "kv_tokens"  # K: KV tokens held by the node at the step's start
    CHUNKS = "chunks"  # list of ChunkField objects: the step's prefill chunks
    NODE = "node"  # optional: the node's id
    ROLE = "role"  # optional: the node's role (decides how a chunk-only step is costed)

    REQUIRED = (INDEX, START, DURATION, DECODE_TOKENS, KV_TOKENS, CHUNKS)


class ChunkField:
    """Fields of one prefill chunk of a step record."""

    REQUEST_ID = "request_id"
    TOKENS = "tokens"  # prompt tokens of this request processed in the step (>= 1)
    CACHED = "cached"  # this request's prompt tokens already computed before the step


class StepsPageField:
    """Fields of the :data:`STEPS_PATH` answer."""

    NODE_ID = "node_id"
    NEXT_INDEX = "next_index"  # one past the newest step's index
    STEPS = "steps"  # the records with index >= since that the node still holds, oldest first


class MalformedStepRecord(ValueError):
    """A step record (or page of them) that does not follow the contract."""


@dataclass(frozen=True, slots=True)
class StepChunk:
    request_id: str
    tokens: int
    cached: int


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One engine step (every :class:`StepField`)."""

    index: int
    start: float
    duration: float
    decode_tokens: int
    kv_tokens: int
    chunks: tuple[StepChunk, ...]
    node: str | None = None
    role: Role | None = None


def encode_step_record(step: EngineStep) -> dict[str, Any]:
    """The step's JSON object (dump it as one JSONL line or in a steps page); node and role only when set."""
    f, ch = StepField, ChunkField
    out: dict[str, Any] = {
        f.INDEX: step.index,
        f.START: step.start,
        f.DURATION: step.duration,
        f.DECODE_TOKENS: step.decode_tokens,
        f.KV_TOKENS: step.kv_tokens,
        f.CHUNKS: [{ch.REQUEST_ID: c.request_id, ch.TOKENS: c.tokens, ch.CACHED: c.cached} for c in step.chunks],
    }
    if step.node is not None:
        out[f.NODE] = step.node
    if step.role is not None:
        out[f.ROLE] = str(step.role)
    return out


def _step_int(obj: Mapping[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise MalformedStepRecord(f"{where}missing key {key!r}")
    value = obj[key]
    if not _is_int(value) or value < minimum:
        raise MalformedStepRecord(f"{where}{key} must be an integer >= {minimum}, got {json.dumps(value)}")
    return value


def parse_step_record(obj: Any) -> EngineStep:
    """Check one decoded step record; the message of a :class:`MalformedStepRecord` names the field."""
    f, ch = StepField, ChunkField
    if not isinstance(obj, dict):
        raise MalformedStepRecord(f"a step record is a JSON object, got {type(obj).__name__}")
    index = _step_int(obj, f.INDEX, "", 0)
    for key in (f.START, f.DURATION):
        if key not in obj:
            raise MalformedStepRecord(f"missing key {key!r}")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise MalformedStepRecord(f"{key} must be a finite number of seconds, got {json.dumps(value)}")
    if obj[f.DURATION] <= 0:
        raise MalformedStepRecord(f"duration must be > 0 seconds, got {obj[f.DURATION]}")
    decode_tokens = _step_int(obj, f.DECODE_TOKENS, "", 0)
    kv_tokens = _step_int(obj, f.KV_TOKENS, "", 0)
    raw_chunks = obj.get(f.CHUNKS)
    if not isinstance(raw_chunks, list):
        raise MalformedStepRecord(f"chunks must be a list, got {json.dumps(raw_chunks)}")
    chunks = []
    for i, chunk in enumerate(raw_chunks):
        at = f"{f.CHUNKS}[{i}]"
        if not isinstance(chunk, dict):
            raise MalformedStepRecord(f"{at} must be an object, got {json.dumps(chunk)}")
        rid = chunk.get(ch.REQUEST_ID)
        if not isinstance(rid, str):
            raise MalformedStepRecord(f"{at}.{ch.REQUEST_ID} must be a string, got {json.dumps(rid)}")
        tokens = _step_int(chunk, ch.TOKENS, f"{at}: ", 1)
        chunks.append(StepChunk(rid, tokens, _step_int(chunk, ch.CACHED, f"{at}: ", 0)))
    role = obj.get(f.ROLE)
    if role is not None and role not in tuple(Role):
        raise MalformedStepRecord(f"role must be one of {[str(r) for r in Role]}, got {json.dumps(role)}")
    node = obj.get(f.NODE)
    return EngineStep(
        index=index,
        start=float(obj[f.START]),
        duration=float(obj[f.DURATION]),
        decode_tokens=decode_tokens,
        kv_tokens=kv_tokens,
        chunks=tuple(chunks),
        node=None if node is None else str(node),
        role=None if role is None else Role(role),
    )


def parse_steps_since(value: str) -> int:
    """The :data:`STEPS_SINCE` query value; ValueError unless a non-negative integer."""
    try:
        since = int(value)
    except ValueError:
        since = -1
    if since < 0:
        raise ValueError(f"{STEPS_SINCE} must be a non-negative integer, got {value!r}")
    return since


@dataclass(frozen=True, slots=True)
class StepsPage:
    """One :data:`STEPS_PATH` answer; the records stay JSON objects (check each with
    :func:`parse_step_record`), so a reader can keep them as the node wrote them."""

    node_id: str | None
    next_index: int
    steps: tuple[dict[str, Any], ...]


def encode_steps_page(node_id: str, next_index: int, steps: Iterable[dict[str, Any]]) -> str:
    """The :data:`STEPS_PATH` answer's JSON; ``steps`` are :func:`encode_step_record` objects."""
    f = StepsPageField
    return json.dumps({f.NODE_ID: node_id, f.NEXT_INDEX: next_index, f.STEPS: list(steps)}, separators=(",", ":"))


def parse_steps_page(raw: bytes | str) -> StepsPage:
    f = StepsPageField
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedStepRecord(f"a steps page is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get(f.STEPS), list) or not _is_int(data.get(f.NEXT_INDEX)):
        raise MalformedStepRecord(
            f"not a step log (expected {{{f.STEPS!r}: [...], {f.NEXT_INDEX!r}: N}}), got {str(raw)[:200]}"
        )
    if not all(isinstance(s, dict) for s in data[f.STEPS]):
        raise MalformedStepRecord("a steps page holds JSON objects only")
    node_id = data.get(f.NODE_ID)
    return StepsPage(None if node_id is None else str(node_id), data[f.NEXT_INDEX], tuple(data[f.STEPS]))
