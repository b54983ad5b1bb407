"""A deflected request's chunk schedule and step budget, as vLLM hands them to the scheduler.

The sidecar puts them in the request body's ``vllm_xargs``; vLLM copies that object into
``sampling_params.extra_args``. This module parses and validates them (the validator plugin
runs it in the API server, so a bad schedule is an HTTP 400; the scheduler runs it again and
trusts nothing it cannot parse) and says how many prompt tokens the schedule allows at step i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kairos.common import contracts as c

SCHEDULE_PARAM = f"vllm_xargs.{c.XARG_CHUNK_SCHEDULE}"
BUDGET_PARAM = f"vllm_xargs.{c.XARG_STEP_BUDGET_MS}"
MAX_SCHEDULE_LENGTH = 4096  # chunks; a 32K prompt in 128-token chunks needs 256


class ScheduleError(ValueError):
    """A malformed chunk schedule or step budget (vLLM turns ValueError into HTTP 400)."""


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Prompt tokens per step for one deflected prefill; the last size repeats."""

    sizes: tuple[int, ...]
    step_budget_s: float | None = None  # longest step this prefill may cause on the node

    def cap(self, step: int) -> int:
        """Most prompt tokens the request may take in its ``step``-th chunk (0-based)."""
        return self.sizes[min(step, len(self.sizes) - 1)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_chunk_plan(extra_args: Mapping[str, Any] | None, max_step_tokens: int | None = None) -> ChunkPlan | None:
    """The request's :class:`ChunkPlan`, or None when it carries no schedule.

    Raises :class:`ScheduleError` for anything malformed: a schedule that is not a non-empty
    list of positive integers, a chunk over the engine's per-step token budget (vLLM would
    silently run a different schedule), or a budget without a schedule.
    """
    if not extra_args:
        return None
    raw, budget = extra_args.get(c.XARG_CHUNK_SCHEDULE), extra_args.get(c.XARG_STEP_BUDGET_MS)
    if raw is None:
        if budget is not None:
            raise ScheduleError(f"{BUDGET_PARAM} needs {SCHEDULE_PARAM}")
        return None
    if not isinstance(raw, list | tuple) or not raw or not all(_is_int(x) and x > 0 for x in raw):
        raise ScheduleError(f"{SCHEDULE_PARAM} must be a non-empty array of positive integers, got {raw!r}")
    if len(raw) > MAX_SCHEDULE_LENGTH:
        raise ScheduleError(f"{SCHEDULE_PARAM} has {len(raw)} chunks, more than {MAX_SCHEDULE_LENGTH}")
    if max_step_tokens is not None:
        too_big = sorted({x for x in raw if x > max_step_tokens})
        if too_big:
            raise ScheduleError(
                f"{SCHEDULE_PARAM} has chunks {too_big} over this node's max_num_batched_tokens of {max_step_tokens}"
            )
    budget_s: float | None = None
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not (0 < budget < math.inf):
            raise ScheduleError(f"{BUDGET_PARAM} must be a positive number of milliseconds, got {budget!r}")
        budget_s = float(budget) / 1e3
    return ChunkPlan(tuple(int(x) for x in raw), budget_s)
