"""``sq`` and ``sl``: the paper's static deflection rules (§3.4)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies.baseline import can_prefill_locally, keep, prefill_locally
from kairos.core.policies.registry import register
from kairos.core.policies.spec import PolicySpec, field_default
from kairos.core.state import ClusterView


@dataclass(frozen=True)
class StaticPolicy:
    """The static deflection rules of §3.4, each with a fixed step size chi (128 in the paper):

    - SQ(theta): deflect when every prefill node's queue holds more than theta requests;
    - SL(l): deflect every request whose prompt is shorter than l tokens.

    They ignore TBT: the deflected request runs chi - B prefill tokens per step on the
    least-loaded fresh decode node, whatever that does to the node's step time.
    """

    models: LatencyModels
    config: alg.DeciderConfig
    kind: str  # "sq" or "sl"
    threshold: int  # theta (requests) for SQ, l (tokens) for SL; defaults in RULES
    chunk_tokens: int = 128
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"sq(theta={self.threshold})" if self.kind == "sq" else f"sl(l={self.threshold})"

    def _fires(self, prompt_tokens: int, view: ClusterView, now: float) -> bool:
        if self.kind == "sl":
            return prompt_tokens < self.threshold
        fresh = [n for n in view.prefill if alg.is_fresh(n.reported_at, now, self.config)]
        return bool(fresh) and all(n.queue_length > self.threshold for n in fresh)

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        if not self._fires(prompt_tokens, view, now):
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_STATIC_RULE)
        fresh = [n for n in view.decode if can_prefill_locally(n, now, self.config, prompt_tokens, self.chunk_tokens)]
        if not fresh:
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        node = min(fresh, key=lambda n: (alg.decode_load_s(self.models, n), n.node_id))
        return prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_STATIC_RULE
        )


# Each rule's threshold parameter and its default: theta = 4 requests, l = 2048 tokens.
RULES: dict[str, tuple[str, int]] = {"sq": ("theta", 4), "sl": ("l", 2048)}


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig, *, kind: str) -> StaticPolicy:
    param, default = RULES[kind]
    threshold = spec.integer(param, default)
    chunk = spec.integer("chunk", field_default(StaticPolicy, "chunk_tokens"))
    if threshold < 0 or chunk < 2:
        raise spec.error(f"threshold={threshold} must be >= 0, chunk={chunk} >= 2")
    return StaticPolicy(models, base, kind, threshold, chunk)


for _kind, (_param, _) in RULES.items():
    register(_kind, partial(build, kind=_kind), {_param: "N", "chunk": "N"})
