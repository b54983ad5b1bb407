"""The engine-state snapshot a vLLM node hands its heartbeat publisher.

The scheduler turns its queues into plain :class:`PendingPrefill` rows and calls
:func:`build_state`; the result is the :class:`~kairos.common.contracts.EngineState` the heartbeat
publisher reads (the one the emulated node serves too), plus request counts and KV usage as
vLLM's own ``/metrics`` define them, so an operator can hold the two side by side.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kairos.common.contracts import EngineState
from kairos.core.slo import tau_scaled_budget_s, tightest_tpot_s


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """A request that still has prompt tokens to compute on this node, in queue order."""

    remaining: int  # prompt tokens not yet computed
    scheduled: bool  # a deflected prefill with a chunk schedule
    computed: int = 0  # prompt tokens computed already (chunks run, or the prefix hit it will start from)


@dataclass(slots=True)
class RequestTpots:
    """The TPOT SLO of each request on the node (``vllm_xargs`` ``kairos_tpot_slo_ms``; None: it
    carries none, the cluster's default), for the step guard and the state: the engine model's
    bookkeeping (kairos.sim.engine), by request id."""

    own_s: dict[str, float | None] = field(default_factory=dict)

    def add(self, request_id: str, tpot_s: float | None) -> None:
        self.own_s[request_id] = tpot_s

    def keep_only(self, live: Collection[str]) -> None:
        """Forget the requests no longer in ``live`` (finished or aborted)."""
        if len(self.own_s) > len(live) or any(rid not in live for rid in self.own_s):
            for rid in [r for r in self.own_s if r not in live]:
                del self.own_s[rid]

    def tightest_s(self, request_ids: Iterable[str] | None = None) -> float | None:
        """The tightest TPOT among ``request_ids`` (every request here when None); None: none."""
        ids = self.own_s.keys() if request_ids is None else request_ids
        return tightest_tpot_s(self.own_s.get(rid) for rid in ids)

    def chunk_budget_s(self, request_id: str, budget_s: float | None, running_tpot_s: float | None) -> float | None:
        """A deflected chunk's step budget beside decodes whose tightest TPOT is ``running_tpot_s``."""
        return tau_scaled_budget_s(budget_s, self.own_s.get(request_id), running_tpot_s)


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
    tpot_slo_s: float | None = None,
    running_step_elapsed_s: float | None = None,
) -> EngineState:
    """The snapshot; ``kv_pulls``: on a decode node, the prompt tokens of each request whose KV it
    has yet to receive from a prefill node, in queue order (None on a prefill node);
    ``tpot_slo_s``: on a decode node, the tightest TPOT SLO among its requests (None: none);
    ``running_step_elapsed_s``: how long the step in flight has run (None: no step in flight)."""
    queued: list[int] = []
    scheduled: list[int] = []
    scheduled_computed: list[int] = []
    queued_computed: list[int] = []
    for p in prefills:
        if p.remaining > 0:
            (scheduled if p.scheduled else queued).append(p.remaining)
            (scheduled_computed if p.scheduled else queued_computed).append(p.computed)
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
        queued_prefill_computed_tokens=tuple(queued_computed),
        pending_kv_pull_tokens=None if kv_pulls is None else tuple(kv_pulls),
        tpot_slo_ms=None if tpot_slo_s is None else tpot_slo_s * 1e3,
        running_step_elapsed_s=running_step_elapsed_s,
        as_of=time.time(),
    )
