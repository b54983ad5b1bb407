"""``aibrix``: AIBrix's fallback from prefill/decode pairs to combined pods, as a baseline (what
the field's deciders share: baseline.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies.baseline import (
    can_prefill_locally,
    chunk_label,
    chunk_param,
    fixed_chunk_schedule,
    keep,
    prefill_locally,
)
from kairos.core.policies.registry import register
from kairos.core.policies.spec import PolicySpec, field_default
from kairos.core.state import ClusterView, DecodeNodeState


@dataclass(frozen=True)
class AibrixPolicy:
    """AIBrix's fallback from prefill/decode pairs to combined pods (vllm-project/aibrix,
    ``pkg/plugins/gateway/algorithms/pd_disaggregation.go`` ``shouldPickCombined`` and
    ``scoreCombinedPods``, the score in ``scorer.go``; ``docs/source/features/pd-disaggregation.rst``;
    read at commit e3e10f9).

    Each pod's drain score is its backlog over its drain rate, (waiting requests + prefill and
    decode pre-allocation queues) / finished requests per second over the last minute: roughly
    the seconds it needs to clear what waits. A request goes to a combined pod (one that runs
    prefill and decode itself) when some combined pod scores below 0.25 and some prefill pod,
    or else some decode pod, scores above 1.0; the combined pod with the lowest score takes it.
    Both thresholds are constants in AIBrix; here ``low`` and ``high`` (seconds). AIBrix checks
    this only with prompt-length bucketing on and combined pods deployed (its other use of them,
    a prompt outside every bucket, has no counterpart here).

    Kairos mapping: Kairos has no separate combined pool; a decode node is the combined pod
    when it prefills a request itself. The drain score is the model's estimate of the same
    quantity, seconds to clear the queued work: a prefill node's Eq. 2 queue wait (its queued
    prefill tokens), a decode node's time to run its deflected backlog with the fixed-budget
    schedule. Ties go to the less loaded node, then the node id (AIBrix shuffles).
    """

    models: LatencyModels
    config: alg.DeciderConfig
    high_s: float = 1.0
    low_s: float = 0.25
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"aibrix(high={self.high_s:g},low={self.low_s:g}{chunk_label(self.chunk_tokens)})"

    def decode_drain_s(self, node: DecodeNodeState) -> float:
        """Seconds to run the node's deflected backlog, each prompt joining the batch once done."""
        b, k, total = node.decode_tokens, node.kv_tokens, 0.0
        for backlog in node.prefill_backlog_tokens:
            if b >= self.chunk_tokens:
                return math.inf  # its decodes fill every step: the backlog never drains
            total += sum(fixed_chunk_schedule(self.models, b, k, backlog, self.chunk_tokens)[1])
            b, k = b + 1, k + backlog
        return total

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)

        cfg = self.config
        prefill_high = any(
            alg.prefill_queue_wait_s(self.models, n) > self.high_s
            for n in view.prefill
            if alg.is_fresh(n.reported_at, now, cfg)
        )
        # AIBrix looks at the decode pods only when no prefill pod is over the line
        high = prefill_high or any(
            self.decode_drain_s(n) > self.high_s for n in view.decode if alg.is_fresh(n.reported_at, now, cfg)
        )
        if not high:
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_AIBRIX_DRAIN)
        eligible = [
            n for n in view.decode if can_prefill_locally(n, now, self.config, prompt_tokens, self.chunk_tokens)
        ]
        if not eligible:
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        scored = [(self.decode_drain_s(n), alg.decode_load_s(self.models, n), n.node_id, n) for n in eligible]
        drain, _, _, node = min(scored, key=lambda x: x[:3])
        if not drain < self.low_s:
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_AIBRIX_DRAIN)
        return prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_AIBRIX_DRAIN
        )


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig) -> AibrixPolicy:
    chunk = chunk_param(spec, AibrixPolicy)
    high = spec.bounded("high", field_default(AibrixPolicy, "high_s"), 0, math.inf)
    low = spec.bounded("low", field_default(AibrixPolicy, "low_s"), 0, math.inf)
    return AibrixPolicy(models, base, high, low, chunk)


register("aibrix", build, {"high": "S", "low": "S", "chunk": "N"})
