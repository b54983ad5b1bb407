"""A deflected prefill's chunk schedule, step budget and TPOT SLO: header values (dispatcher ->
sidecar) and ``vllm_xargs`` (sidecar -> the node's vLLM plugin or emulated node)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kairos.common.contracts._checks import is_int
from kairos.common.contracts.headers import H_CHUNK_SCHEDULE, H_DECIDED_TPOT_SLO_MS, H_SPLIT_TOKENS, H_STEP_BUDGET_MS

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


def encode_split_tokens(split_tokens: int) -> str:
    """The :data:`H_SPLIT_TOKENS` value: k, the prompt's leading tokens the prefill node computes."""
    return str(split_tokens)


def parse_split_tokens(value: str, prompt_tokens: int | None = None) -> int:
    """Decode :data:`H_SPLIT_TOKENS`; :class:`MalformedSchedule` unless it is a positive integer
    (below ``prompt_tokens`` where that is known: the decode node prefills at least one token)."""
    k = int(value) if value.isdecimal() else 0
    if k < 1 or (prompt_tokens is not None and k >= prompt_tokens):
        within = "" if prompt_tokens is None else f" below the prompt's {prompt_tokens} tokens"
        raise MalformedSchedule(f"{H_SPLIT_TOKENS}={value!r} is not a positive integer{within}")
    return k


def encode_step_budget_ms(budget_ms: float) -> str:
    """The :data:`H_STEP_BUDGET_MS` value (microsecond resolution)."""
    return f"{budget_ms:.3f}"


def parse_step_budget_ms(value: str) -> float:
    """Decode :data:`H_STEP_BUDGET_MS` (milliseconds, as ``vllm_xargs`` carries it)."""
    return _positive_header(H_STEP_BUDGET_MS, value)


def parse_tpot_slo_ms(value: str) -> float:
    """Decode :data:`H_DECIDED_TPOT_SLO_MS` (milliseconds, as :data:`XARG_TPOT_SLO_MS` carries it)."""
    return _positive_header(H_DECIDED_TPOT_SLO_MS, value)


def _positive_header(header: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise MalformedSchedule(f"{header}={value!r} is not a positive number")
    return number


def _positive_number(value: Any) -> bool:
    """A JSON number (never a bool) that is finite and > 0."""
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def schedule_xargs(sizes: Sequence[int], step_budget_ms: float | None = None) -> dict[str, Any]:
    """The :data:`VLLM_XARGS` entries that carry a schedule (merge them into the body's own)."""
    xargs: dict[str, Any] = {XARG_CHUNK_SCHEDULE: list(sizes)}
    if step_budget_ms is not None:
        xargs[XARG_STEP_BUDGET_MS] = step_budget_ms
    return xargs


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
    if not isinstance(raw, list | tuple) or not raw or not all(is_int(x) and x > 0 for x in raw):
        raise MalformedSchedule(f"{SCHEDULE_PARAM} must be a non-empty array of positive integers, got {raw!r}")
    _check_chunk_count(SCHEDULE_PARAM, len(raw))
    budget_s: float | None = None
    if budget is not None:
        if not _positive_number(budget):
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
    if not _positive_number(raw):
        raise MalformedSchedule(f"{TPOT_PARAM} must be a positive number of milliseconds, got {raw!r}")
    return float(raw) / 1e3
