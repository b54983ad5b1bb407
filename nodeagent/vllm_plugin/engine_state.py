"""The engine-state snapshot a vLLM node hands its heartbeat publisher.

The scheduler turns its queues into plain :class:`PendingPrefill` rows and calls
:func:`build_state`; the result is the :class:`~kairos.common.contracts.EngineState` the heartbeat
publisher reads (the one the emulated node serves too), plus request counts and KV usage as
vLLM's own ``/metrics`` define them, so an operator can hold the two side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kairos.common.contracts import EngineState


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """A request that still has prompt tokens to compute on this node, in queue order."""

    remaining: int  # prompt tokens not yet computed
    scheduled: bool  # a deflected prefill with a chunk schedule
    computed: int = 0  # prompt tokens computed already (chunks run, or the prefix hit it will start from)


def build_state(
    *,
    decode_tokens: int,
    kv_tokens: int,
    kv_capacity_tokens: int,
    prefills: Iterable[PendingPrefill],
    max_step_tokens: int,
    model: str,
    running_requests: int,
    waiting_requests: int,
    kv_usage: float,
    step_calibration: float | None = None,
    kv_pulls: Iterable[int] | None = None,
) -> EngineState:
    """The snapshot; ``kv_pulls``: on a decode node, the prompt tokens of each request whose KV it
    has yet to receive from a prefill node, in queue order (None on a prefill node)."""
    queued: list[int] = []
    scheduled: list[int] = []
    scheduled_computed: list[int] = []
    for p in prefills:
        if p.remaining > 0:
            (scheduled if p.scheduled else queued).append(p.remaining)
            if p.scheduled:
                scheduled_computed.append(p.computed)
    return EngineState(
        decode_tokens=decode_tokens,
        kv_tokens=kv_tokens,
        kv_capacity_tokens=kv_capacity_tokens,
        queued_prefill_tokens=tuple(queued),
        scheduled_prefill_tokens=tuple(scheduled),
        max_step_tokens=max_step_tokens,
        model=model,
        running_requests=running_requests,
        waiting_requests=waiting_requests,
        kv_usage=round(kv_usage, 6),
        step_calibration=step_calibration,
        scheduled_prefill_computed_tokens=tuple(scheduled_computed),
        pending_kv_pull_tokens=None if kv_pulls is None else tuple(kv_pulls),
        as_of=time.time(),
    )
