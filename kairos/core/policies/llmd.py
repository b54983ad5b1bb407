"""``llmd``: llm-d's P/D decider, as a baseline (what the field's deciders share: baseline.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies.baseline import can_prefill_locally, chunk_label, chunk_param, keep, prefill_locally
from kairos.core.policies.registry import register
from kairos.core.policies.spec import PolicySpec, field_default
from kairos.core.state import ClusterView


@dataclass(frozen=True)
class LlmdPolicy:
    """llm-d's P/D decider (llm-d-inference-scheduler, ``prefix-based-pd-decider`` under
    ``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/``; read at commit 520af47).

    Rule: the decode profile picks the decode pod first; the decider then disaggregates (remote
    prefill) when the prompt's tokens not cached on that pod are at least ``nonCachedTokens``,
    and otherwise the decode pod runs the whole request. ``nonCachedTokens = 0`` (the plugin's
    own default) turns disaggregation off: every request runs on its decode pod.

    Parameters: ``threshold`` = nonCachedTokens, default 16 (the repo's P/D deployment config
    ``deploy/config/pd-epp-config.yaml``; its docs' example uses 8); ``chunk`` = the decode
    node's per-step token budget. llm-d estimates tokens as characters / 4; Kairos counts them.

    Kairos mapping: uncached tokens = the prompt's tokens; the decode pod = the keep path's
    least-loaded decode node (llm-d scores by prefix hits and queue length). A node that is
    stale, lacks KV room for the prompt or whose decodes fill the step budget cannot take it
    (the request is kept).
    """

    models: LatencyModels
    config: alg.DeciderConfig
    threshold: int = 16
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"llmd(threshold={self.threshold}{chunk_label(self.chunk_tokens)})"

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        uncached = prompt_tokens  # cache-blind here (see above)
        if self.threshold != 0 and uncached >= self.threshold:
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_LLMD_THRESHOLD)
        node = alg.pick_keep_decode_node(self.models, view, now, self.config, prompt_tokens)
        if not can_prefill_locally(node, now, self.config, prompt_tokens, self.chunk_tokens):
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        return prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_LLMD_THRESHOLD
        )


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig) -> LlmdPolicy:
    chunk = chunk_param(spec, LlmdPolicy)
    threshold = spec.integer("threshold", field_default(LlmdPolicy, "threshold"))
    if threshold < 0:
        raise spec.error(f"threshold={threshold} must be >= 0 (0: never disaggregate)")
    return LlmdPolicy(models, base, threshold, chunk)


register("llmd", build, {"threshold": "N", "chunk": "N"})
