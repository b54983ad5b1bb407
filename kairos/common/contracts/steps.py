"""Step records: one JSON object per engine step."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

from kairos.common.contracts._checks import is_int
from kairos.common.contracts._schema import FieldNames, decode_object, to_json_object
from kairos.common.contracts.role import Role

# ---------------------------------------------------------------------------------------------
# Step records: one JSON object per engine step, written by the vLLM step recorder (JSONL and
# STEPS_PATH), the emulated node (STEPS_PATH) and the profiler's virtual engine; read by the
# profiler. Times are model seconds (wall seconds on real vLLM).
# ---------------------------------------------------------------------------------------------
STEPS_PATH = "/kairos/steps"  # GET ?since=N: a page of the node's newest step records
STEPS_SINCE = "since"  # the query parameter: the first step index wanted


class MalformedStepRecord(ValueError):
    """A step record (or page of them) that does not follow the contract."""


# The contract's checks on a record's values, as msgspec constraints (parse_step_record's messages
# say them in words): counts >= 0, a chunk of >= 1 token, times in seconds, a duration > 0.
Count = Annotated[int, msgspec.Meta(ge=0)]
ChunkTokens = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(extra={"unit": "seconds"})]
Duration = Annotated[float, msgspec.Meta(gt=0, extra={"unit": "seconds"})]


class StepChunk(msgspec.Struct, frozen=True):
    """One prefill chunk of a step record (every :class:`ChunkField`)."""

    request_id: str
    tokens: ChunkTokens  # prompt tokens of this request processed in the step
    cached: Count  # this request's prompt tokens already computed before the step


class EngineStep(msgspec.Struct, frozen=True, omit_defaults=True):
    """One engine step, field by field in the record's order (every :class:`StepField`; extra
    keys in a record are allowed and ignored). Building one in Python checks nothing;
    :func:`parse_step_record` checks a record against these types."""

    index: Count  # the engine's step counter (per node)
    start: Seconds  # model seconds when the step started
    duration: Duration  # model seconds the step took
    decode_tokens: Count  # B: running decodes in the step, one token each
    kv_tokens: Count  # K: KV tokens held by the node at the step's start
    chunks: tuple[StepChunk, ...]  # the step's prefill chunks
    node: str | None = None  # the node's id
    role: Role | None = None  # the node's role (decides how a chunk-only step is costed)


class StepField(FieldNames, struct=EngineStep):
    """The step record's keys (:class:`EngineStep`'s fields; REQUIRED, the first six)."""


class ChunkField(FieldNames, struct=StepChunk):
    """The keys of one prefill chunk of a step record (:class:`StepChunk`'s fields)."""


def encode_step_record(step: EngineStep) -> dict[str, Any]:
    """The step's JSON object (dump it as one JSONL line or in a steps page); node and role only when set."""
    return to_json_object(step)


def parse_step_record(obj: Any) -> EngineStep:
    """Check one decoded step record against :class:`EngineStep`; the message of a
    :class:`MalformedStepRecord` names the field (``chunks[0]: tokens must be an int >= 1, got 0``)."""
    if not isinstance(obj, dict):
        raise MalformedStepRecord(f"a step record is a JSON object, got {type(obj).__name__}")
    return decode_object(obj, EngineStep, MalformedStepRecord)


def parse_steps_since(value: str) -> int:
    """The :data:`STEPS_SINCE` query value; ValueError unless a non-negative integer."""
    try:
        since = int(value)
    except ValueError:
        since = -1
    if since < 0:
        raise ValueError(f"{STEPS_SINCE} must be a non-negative integer, got {value!r}")
    return since


class StepsPage(msgspec.Struct, frozen=True):
    """One :data:`STEPS_PATH` answer; the records stay JSON objects (check each with
    :func:`parse_step_record`), so a reader can keep them as the node wrote them."""

    node_id: str | None
    next_index: int  # one past the newest step's index
    steps: tuple[dict[str, Any], ...]  # the records with index >= since that the node still holds, oldest first


class StepsPageField(FieldNames, struct=StepsPage):
    """The :data:`STEPS_PATH` answer's keys (:class:`StepsPage`'s fields)."""


def encode_steps_page(node_id: str, next_index: int, steps: Iterable[dict[str, Any]]) -> str:
    """The :data:`STEPS_PATH` answer's JSON; ``steps`` are :func:`encode_step_record` objects."""
    return json.dumps(to_json_object(StepsPage(node_id, next_index, tuple(steps))), separators=(",", ":"))


def parse_steps_page(raw: bytes | str) -> StepsPage:
    f = StepsPageField
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedStepRecord(f"a steps page is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get(f.STEPS), list) or not is_int(data.get(f.NEXT_INDEX)):
        raise MalformedStepRecord(
            f"not a step log (expected {{{f.STEPS!r}: [...], {f.NEXT_INDEX!r}: N}}), got {str(raw)[:200]}"
        )
    if not all(isinstance(s, dict) for s in data[f.STEPS]):
        raise MalformedStepRecord("a steps page holds JSON objects only")
    node_id = data.get(f.NODE_ID)
    return StepsPage(None if node_id is None else str(node_id), data[f.NEXT_INDEX], tuple(data[f.STEPS]))
