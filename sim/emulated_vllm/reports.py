"""What the emulated node reports: ``/metrics``, ``/kairos/state`` and ``/kairos/steps``."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kairos.api.openai_request import RequestError
from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.core.slo import tightest_tpot_s
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig
from kairos.sim.emulated_vllm.kv_transfer import PendingPull
from kairos.sim.emulated_vllm.metrics import Metrics
from kairos.sim.realtime import RealtimeEngine


class NodeReports:
    """:class:`~kairos.sim.emulated_vllm.node.EmulatedNode`'s reports: ``/metrics`` in vLLM's names,
    ``/kairos/state`` (what the heartbeat publisher reads) and ``/kairos/steps`` (the step log)."""

    # The node's, set by EmulatedNode (engine: its property, the running engine or a 503).
    config: EmulatedNodeConfig
    metrics: Metrics
    engine: RealtimeEngine
    _transferring: int
    _pulls: list[PendingPull]
    _pull_started: float | None

    async def metrics_text(self, request: web.Request) -> web.Response:
        rt = self.engine
        e, labels = rt.engine, self.metrics.labels
        self.metrics.running.labels(**labels).set(len(e.prefilling) + len(e.decoding) + len(e.joining))
        self.metrics.waiting.labels(**labels).set(len(e.waiting) + rt.pending_transfers + self._transferring)
        self.metrics.kv_usage.labels(**labels).set(e.kv_used / e.config.kv_capacity_tokens)
        self.metrics.step_budget_overruns.inc(rt.step_budget_overruns - self.metrics.overruns_exported)
        self.metrics.overruns_exported = rt.step_budget_overruns
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(self, request: web.Request) -> web.Response:
        rt = self.engine
        engine = rt.engine
        snap = engine.snapshot(rt.now())  # its step in flight's run so far in model seconds, as every time here
        decode = self.config.role is Role.DECODE
        pulls = self._pulls if decode else []
        # A split whose KV is on its way reports its rest as the vLLM plugin does: a prefill with its
        # k computed, after the admitted prefills of its kind and ahead of those still waiting
        # (where vLLM's scheduler lists it, and where Engine.accept_partial puts it on landing).
        scheduled, scheduled_computed = _with_rests(
            snap.scheduled_prefill_tokens,
            snap.scheduled_prefill_computed_tokens,
            sum(1 for seq in engine.prefilling if seq.schedule),
            [p for p in pulls if p.rest and p.scheduled],
        )
        queued, queued_computed = _with_rests(
            snap.queued_prefill_tokens,
            snap.queued_prefill_computed_tokens,
            sum(1 for seq in engine.prefilling if not seq.schedule),
            [p for p in pulls if p.rest and not p.scheduled],
        )
        # The tightest TPOT among the requests in flight, those whose KV is on its way too.
        pulling = tightest_tpot_s(p.tpot_slo_s for p in pulls)
        tpot_s = min((t for t in (snap.tpot_slo_s, pulling) if t is not None), default=None)
        state = c.EngineState(
            decode_tokens=snap.decode_tokens,
            kv_tokens=snap.kv_tokens,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            queued_prefill_tokens=queued,
            scheduled_prefill_tokens=scheduled,
            max_step_tokens=snap.max_step_tokens,
            model=self.config.model,
            step_calibration=snap.step_calibration,
            pending_kv_pull_tokens=tuple(p.tokens for p in pulls) if decode else None,
            scheduled_prefill_computed_tokens=scheduled_computed,
            tpot_slo_ms=None if tpot_s is None else tpot_s * 1e3,
            queued_prefill_computed_tokens=queued_computed,
            running_step_elapsed_s=snap.running_step_elapsed_s,
            running_kv_pull_elapsed_s=None if self._pull_started is None else max(0.0, rt.now() - self._pull_started),
        )
        return web.Response(text=c.encode_engine_state(state), content_type="application/json")

    async def steps(self, request: web.Request) -> web.Response:
        try:
            since = c.parse_steps_since(request.query.get(c.STEPS_SINCE, "0"))
        except ValueError as exc:
            raise RequestError(str(exc), c.STEPS_SINCE) from None
        rt = self.engine
        page = c.encode_steps_page(self.config.node_id, rt.engine.step_index, rt.steps_since(since))
        return web.Response(text=page, content_type="application/json")


def _with_rests(
    tokens: Sequence[int], computed: Sequence[int], admitted: int, rests: Sequence[PendingPull]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A prefill queue's remaining and computed tokens with the rests of the splits whose KV is on
    its way put after its first ``admitted`` (each a rest of l - k tokens with its k computed)."""
    if not rests:
        return tuple(tokens), tuple(computed)
    return (
        (*tokens[:admitted], *(p.rest for p in rests), *tokens[admitted:]),
        (*computed[:admitted], *(p.tokens for p in rests), *computed[admitted:]),
    )
