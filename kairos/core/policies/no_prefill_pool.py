"""The gateway's degraded mode with no prefill pool. Not a routing policy to compare, so not
registered by name: the dispatcher uses it when no prefill node is fresh."""

from __future__ import annotations

from dataclasses import dataclass

from kairos.core import algorithm as alg
from kairos.core.decision import Decision
from kairos.core.latency import LatencyModels
from kairos.core.slo import RequestSLO
from kairos.core.state import ClusterView


@dataclass(frozen=True)
class NoPrefillPoolPolicy:
    """The gateway's degraded mode, not a routing policy to compare: with no prefill node
    registered, a decode node prefills the request itself (see
    :func:`kairos.core.algorithm.decide_without_prefill_pool`)."""

    models: LatencyModels
    config: alg.DeciderConfig
    label: str = "no-prefill-pool"
    fresh_state: bool = False
    slo_aware: bool = True

    def applies(self, view: ClusterView, now: float) -> bool:
        """No fresh prefill node, and a fresh decode node to prefill instead."""
        fresh = lambda nodes: any(alg.is_fresh(n.reported_at, now, self.config) for n in nodes)  # noqa: E731
        return not fresh(view.prefill) and fresh(view.decode)

    def decide(self, prompt_tokens: int, view: ClusterView, now: float, slo: RequestSLO | None = None) -> Decision:
        return alg.decide_without_prefill_pool(prompt_tokens, view, now, self.models, self.config, slo)
