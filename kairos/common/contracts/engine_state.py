"""The engine state: what a node's vLLM (its Kairos scheduler plugin) or emulated vLLM serves at
:data:`STATE_PATH` for its heartbeat publisher. One encoder (both servers), one decoder (the
publisher).

Its fields are the heartbeat's load fields, declared once in :class:`~.heartbeat.Heartbeat`:
:class:`EngineState` is that struct less the fields the publisher fills in itself, plus the
snapshot's time. A load field added to the heartbeat is in the engine state, its names, its
encoder and its decoder with no edit here.
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any

import msgspec

from kairos.common.contracts._checks import json_object
from kairos.common.contracts._schema import FieldNames, check_fields, decode_fields
from kairos.common.contracts.heartbeat import Heartbeat, HeartbeatField, check_prefixes
from kairos.common.errors import KairosError

STATE_PATH = "/kairos/state"

# The heartbeat's fields that its publisher fills in from its own config and clock, not the engine's.
PUBLISHER_FIELDS = (
    HeartbeatField.NODE_ID,
    HeartbeatField.ROLE,
    HeartbeatField.URL,
    HeartbeatField.SIDECAR,
    HeartbeatField.SEQ,
    HeartbeatField.SENT_AT,
    *HeartbeatField.KV_EVENTS,
)


class EngineStateError(KairosError):
    """The engine's state could not be read or is malformed."""

    code = "engine_state_unavailable"


def _check(state: Any) -> None:
    """An engine state built in Python is checked as the decoder checks one read off the wire."""
    check_fields(state, EngineStateError, "engine state: ")
    check_prefixes(state, EngineStateError, "engine state: ")


def engine_state_fields(heartbeat: type[Heartbeat]) -> list[tuple[str, Any] | tuple[str, Any, Any]]:
    """The engine state's fields (``msgspec.defstruct``'s form): the heartbeat's, less the
    publisher's, in the heartbeat's order, then as_of."""
    hints = typing.get_type_hints(heartbeat, include_extras=True)
    # vLLM's kv_cache_usage_perc is a fraction: the engine's own report is held to [0, 1] (the
    # heartbeat decoder, reading nodes of every version, only to >= 0).
    hints[HeartbeatField.KV_USAGE] = Annotated[float, msgspec.Meta(ge=0, le=1)] | None
    load = [
        (f.name, hints[f.name]) if f.required else (f.name, hints[f.name], f.default)
        for f in msgspec.structs.fields(heartbeat)
        if f.name not in PUBLISHER_FIELDS
    ]
    return [*load, ("as_of", float | None, None)]  # unix seconds the snapshot was taken (informational)


# What the engine reports each beat: decode_tokens (B), kv_tokens (K), kv_capacity_tokens, the
# queued and scheduled prefills (tuples, FIFO), max_step_tokens (max_num_batched_tokens), model;
# optionally (None: the engine does not say) what real vLLM's /metrics report, the node's step
# calibration, its KV pulls, the computed prefixes, the tightest TPOT SLO, how long the step and
# the KV pull in flight have run, and as_of. Building one checks it (EngineStateError naming the field).
EngineState = msgspec.defstruct(
    "EngineState",
    engine_state_fields(Heartbeat),
    namespace={"__post_init__": _check, "__doc__": "One engine-state snapshot (every EngineStateField)."},
    module=__name__,
    frozen=True,
    omit_defaults=True,
)


class EngineStateField(FieldNames, struct=EngineState):
    """The engine-state JSON object's keys: the heartbeat's load fields by the same names, and AS_OF."""


def encode_engine_state(state: EngineState) -> str:
    """The state's compact JSON, as served at :data:`STATE_PATH`; unset optional fields left out."""
    return json.dumps(msgspec.to_builtins(state), separators=(",", ":"))


def parse_engine_state(raw: bytes | str) -> EngineState:
    """Parse and check one engine-state JSON (lists become tuples; unknown keys are ignored)."""
    data = json_object(raw, EngineStateError, "engine state: ")
    return EngineState(**decode_fields(data, EngineState, EngineStateError, "engine state: "))


def heartbeat_load(state: EngineState) -> dict[str, Any]:
    """The state's fields as the heartbeat carries them (by the same names; all but as_of)."""
    return {name: getattr(state, name) for name in state.__struct_fields__ if name != EngineStateField.AS_OF}
