"""``pd``: plain P/D disaggregation, never deflecting (the keep path every other policy falls
back to)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies.baseline import keep
from kairos.core.policies.registry import register
from kairos.core.policies.spec import PolicySpec
from kairos.core.state import ClusterView


@dataclass(frozen=True)
class PDPolicy:
    """Plain P/D disaggregation: never deflect. Prefix-aware (the default), it picks the prefill
    node by Eq. 1 over each node's uncached tokens and the decode node by load and the blocks it
    lacks, as the field's prefix-aware routers do."""

    models: LatencyModels
    config: alg.DeciderConfig
    fresh_state: bool = False
    prefix_aware: bool = True

    @property
    def label(self) -> str:
        return "pd" if self.prefix_aware else "pd(prefix=off)"

    def decide(
        self, prompt_tokens: int, view: ClusterView, now: float, cached: Mapping[str, int] | None = None
    ) -> Decision:
        alg.validate_prompt(prompt_tokens)
        hits = cached if self.prefix_aware else None
        return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_POLICY, hits)


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig) -> PDPolicy:
    return PDPolicy(models, base, prefix_aware=spec.on_off("prefix"))


register("pd", build, {"prefix": "off"})
