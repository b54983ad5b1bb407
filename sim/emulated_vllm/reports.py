"""What the emulated node reports: ``/metrics``, ``/kairos/state`` and ``/kairos/steps``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kairos.api.openai_request import RequestError
from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig
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
    _pulls: list[int]
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
        snap = rt.engine.snapshot(rt.now())  # its step in flight's run so far in model seconds, as every time here
        state = c.EngineState(
            decode_tokens=snap.decode_tokens,
            kv_tokens=snap.kv_tokens,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            queued_prefill_tokens=snap.queued_prefill_tokens,
            scheduled_prefill_tokens=snap.scheduled_prefill_tokens,
            max_step_tokens=snap.max_step_tokens,
            model=self.config.model,
            step_calibration=snap.step_calibration,
            pending_kv_pull_tokens=tuple(self._pulls) if self.config.role is Role.DECODE else None,
            scheduled_prefill_computed_tokens=snap.scheduled_prefill_computed_tokens,
            tpot_slo_ms=None if snap.tpot_slo_s is None else snap.tpot_slo_s * 1e3,
            queued_prefill_computed_tokens=snap.queued_prefill_computed_tokens,
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
