"""Test helpers: latency models with round, hand-computable coefficients, and node/view builders.

Default models (every coefficient can be overridden by keyword):

- prefill step   = 0.010 + 0.0001 * tokens (+ 0 * tokens*cached, knee far away)
- decode step    = T0(B, K) = 0.040 + 0.001 * B + 0 * K
- mixed increment = 0.0001 * p + 1e-7 * p * c   (p = step tokens - B prefill tokens, c = cached),
  so a step of p tokens over c cached ones costs 0.040 + 0.001 B + 0.0001 p + 1e-7 p c
- kv transfer    = 0.001 s + tokens * 1000 B / 1e6 B/s
"""

from __future__ import annotations

import json
from typing import Any

from kairos.common import contracts as c
from kairos.common.contracts import Heartbeat, Role, encode_heartbeat
from kairos.core.latency import LatencyModels
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState

FAR_KNEE = 1_000_000.0  # tokens: never reached unless a test sets its own knee
BIG_KV = 10_000_000  # tokens of KV capacity: never full unless a test says so


def models_dict(
    *,
    prefill_b0: float = 0.010,
    prefill_per_token: float = 1e-4,
    prefill_over_knee: float = 0.0,
    prefill_x_cached: float = 0.0,
    prefill_knee: float = FAR_KNEE,
    decode_b0: float = 0.040,
    decode_per_b: float = 0.001,
    decode_per_k: float = 0.0,
    mixed_b0: float = 0.0,
    mixed_per_p: float = 1e-4,
    mixed_p_x_b: float = 0.0,
    mixed_p_x_k: float = 0.0,
    mixed_p_x_cached: float = 1e-7,
    mixed_over_knee: float = 0.0,
    mixed_knee: float = FAR_KNEE,
    bytes_per_token: float = 1000.0,
    bandwidth_bytes_per_s: float = 1e6,
    transfer_latency_s: float = 0.001,
) -> dict[str, Any]:
    """A profile dict in the file format of :mod:`kairos.common.contracts`."""
    return {
        "schema_version": c.PROFILE_SCHEMA_VERSION,
        "name": "test-round",
        "model": "test-model",
        "hardware": "test-hw",
        "provenance": {"kind": "test", "measured": False},
        "models": {
            c.PREFILL_STEP: {
                "features": list(c.LINEAR_MODEL_FEATURES[c.PREFILL_STEP]),
                "coefficients": [prefill_per_token, prefill_over_knee, prefill_x_cached],
                "intercept": prefill_b0,
                "knee_tokens": prefill_knee,
                "mape": None,
                "samples": None,
            },
            c.DECODE_STEP: {
                "features": list(c.LINEAR_MODEL_FEATURES[c.DECODE_STEP]),
                "coefficients": [decode_per_b, decode_per_k],
                "intercept": decode_b0,
                "mape": 0.05,
                "samples": 120,
            },
            c.MIXED_INCREMENT: {
                "features": list(c.LINEAR_MODEL_FEATURES[c.MIXED_INCREMENT]),
                "coefficients": [mixed_per_p, mixed_p_x_b, mixed_p_x_k, mixed_p_x_cached, mixed_over_knee],
                "intercept": mixed_b0,
                "knee_tokens": mixed_knee,
                "mape": None,
                "samples": None,
            },
            c.KV_TRANSFER: {
                "bytes_per_token": bytes_per_token,
                "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
                "latency_s": transfer_latency_s,
                "mape": None,
            },
        },
    }


def make_models(**overrides: float) -> LatencyModels:
    """``LatencyModels`` with the round coefficients above, via ``LatencyModels.from_dict``."""
    return LatencyModels.from_dict(models_dict(**overrides), source="tests.builders")


def flat_models(**overrides: float) -> LatencyModels:
    """The default models without the cached-token interaction: every chunk of p tokens on a
    node with B decodes costs 0.040 + 0.001 B + 0.0001 p, whatever came before it."""
    return make_models(**{"mixed_p_x_cached": 0.0, **overrides})


def queue_load(queue: tuple[int, ...] | PrefillNodeState) -> tuple[int, int, int]:
    """A prefill queue as the decision state holds it, from a node's state or from its requests'
    remaining tokens: (requests, tokens, the sum of their squares)."""
    if isinstance(queue, PrefillNodeState):
        return queue.queue_length, queue.outstanding_tokens, queue.squared_tokens
    return len(queue), sum(queue), sum(n * n for n in queue)


def prefill_node(
    node_id: str = "p1",
    queue: tuple[int, ...] = (),
    chunk: int = 1000,
    reported_at: float = 0.0,
) -> PrefillNodeState:
    return PrefillNodeState.from_queue(node_id, queue, chunk_tokens=chunk, reported_at=reported_at)


def decode_node(
    node_id: str = "d1",
    b: int = 0,
    k: int = 0,
    capacity: int = BIG_KV,
    reported_at: float = 0.0,
    backlog: tuple[int, ...] = (),
) -> DecodeNodeState:
    return DecodeNodeState(
        node_id=node_id,
        decode_tokens=b,
        kv_tokens=k,
        kv_capacity_tokens=capacity,
        reported_at=reported_at,
        prefill_backlog_tokens=backlog,
    )


def view(prefill: tuple[PrefillNodeState, ...] = (), decode: tuple[DecodeNodeState, ...] = ()) -> ClusterView:
    return ClusterView(prefill=tuple(prefill), decode=tuple(decode))


def heartbeat_json(
    node_id: str, seq: int = 1, *, role: str | None = None, sent_at: float = 1000.0, **fields: Any
) -> str:
    """A heartbeat value as a publisher SETs it (role from the id's first letter unless given:
    ``d*`` decode, anything else prefill); ``fields`` override any heartbeat field."""
    role = role or ("decode" if node_id.startswith("d") else "prefill")
    hb = Heartbeat(
        node_id=node_id,
        role=Role(role),
        url="10.0.0.1:8100",
        sidecar="10.0.0.1:8200" if role == "decode" else "",
        seq=seq,
        sent_at=sent_at,
        decode_tokens=0,
        kv_tokens=0,
        kv_capacity_tokens=50_000,
        queued_prefill_tokens=(),
        scheduled_prefill_tokens=(),
        max_step_tokens=512,
        model="m",
    )
    data = json.loads(encode_heartbeat(hb))
    data.update(fields)
    return json.dumps(data)
