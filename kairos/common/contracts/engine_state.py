"""The engine state: what a node's vLLM plugin or emulated vLLM serves for its heartbeat publisher."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kairos.common.contracts._checks import is_int, json_object, list_or_none
from kairos.common.contracts.heartbeat import (
    STEP_CALIBRATION_MAX,
    STEP_CALIBRATION_MIN,
    HeartbeatField,
    check_prefixes,
)
from kairos.common.errors import KairosError

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
            if not is_int(value) or value < 0:
                raise EngineStateError(f"engine state: {name} must be an int >= 0, got {value!r}")
        if self.max_step_tokens < 1:
            raise EngineStateError(f"engine state: max_step_tokens must be >= 1, got {self.max_step_tokens}")
        for name in ("queued_prefill_tokens", "scheduled_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(is_int(x) and x >= 0 for x in value):
                raise EngineStateError(f"engine state: {name} must be a tuple of ints >= 0, got {value!r}")
        if not isinstance(self.model, str):
            raise EngineStateError(f"engine state: model must be a string, got {self.model!r}")
        for name in ("running_requests", "waiting_requests"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise EngineStateError(f"engine state: {name} must be an int >= 0, got {value!r}")
        for name in ("pending_kv_pull_tokens", "scheduled_prefill_computed_tokens", "queued_prefill_computed_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, tuple) or not all(is_int(x) and x >= 0 for x in value)):
                raise EngineStateError(f"engine state: {name} must be a tuple of ints >= 0, got {value!r}")
        check_prefixes(self, EngineStateError, "engine state: ")
        usage = self.kv_usage
        if usage is not None and (isinstance(usage, bool) or not isinstance(usage, int | float) or not 0 <= usage <= 1):
            raise EngineStateError(f"engine state: kv_usage must be a number in [0, 1], got {usage!r}")
        check_step_calibration(self.step_calibration, EngineStateError)
        check_tpot_slo_ms(self.tpot_slo_ms, EngineStateError)
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
        f.SCHEDULED_PREFILL_COMPUTED_TOKENS: list_or_none(state.scheduled_prefill_computed_tokens),
        f.TPOT_SLO_MS: state.tpot_slo_ms,
        f.QUEUED_PREFILL_COMPUTED_TOKENS: list_or_none(state.queued_prefill_computed_tokens),
        f.AS_OF: state.as_of,
    }
    out |= {k: v for k, v in optional.items() if v is not None}
    return json.dumps(out, separators=(",", ":"))


def parse_engine_state(raw: bytes | str) -> EngineState:
    """Parse and check one engine-state JSON (lists become tuples; unknown keys are ignored)."""
    data = json_object(raw, EngineStateError, "engine state: ")
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
