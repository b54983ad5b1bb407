"""``dynamo``: NVIDIA Dynamo's conditional disaggregation, as a baseline (what the field's
deciders share: baseline.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies.baseline import can_prefill_locally, chunk_label, chunk_param, keep, prefill_locally
from kairos.core.policies.registry import register
from kairos.core.policies.spec import PolicySpec, field_default
from kairos.core.state import ClusterView

DYNAMO_MODES = ("isl", "load", "either")


@dataclass(frozen=True)
class DynamoPolicy:
    """NVIDIA Dynamo's conditional disaggregation (experimental; ai-dynamo/dynamo,
    ``lib/kv-router/src/conditional_disagg.rs``, the call site
    ``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs`` and the "Conditional
    Disaggregation" docs page; read at commits 088ca50 / 07a6c9c).

    The router peeks at the decode worker it would pick, then bypasses remote prefill (prefill
    and decode on that worker) when the policy says so:

    - ``isl`` (``isl_bounding``, Dynamo's default policy): effective ISL < ``eff_isl_threshold``
      (2048) and effective / raw ISL < ``eff_isl_ratio_threshold`` (0.7), both strict;
    - ``load`` (``prefill_load``): the prefill worker the router would pick is busy,
      ``active_prefill_tokens > prefill_busy_threshold x max_num_batched_tokens``; the busy
      threshold inherits ``router_queue_threshold`` when unset, whose default has moved between
      releases (unset, 4.0 in the ``KvRouterConfig`` default read here, 16.0 in a later router
      README): ``busy`` defaults to 4;
    - ``either`` (``isl_or_load``): either condition.

    The decode-busy guard then vetoes a bypass when the decode worker's projected active KV
    (this request included) exceeds ``decode_busy_threshold`` x its KV capacity. Dynamo leaves it
    unset (off) by default; its B200/H200 recipes set 0.5, which is the default here
    (``kv=off`` disables it).

    Kairos mapping: effective ISL = the prompt's tokens and the ratio is 1 (hits not read here),
    so ``isl`` alone never bypasses here, exactly as in Dynamo on cache-cold traffic; the prefill
    worker = the prefill node with the lowest Eq. 1 TTFT, its active tokens = the prefill tokens
    its heartbeat queues (plus this dispatcher's dispatches since), max_num_batched_tokens = its
    chi_p; the decode worker = the keep path's least-loaded decode node, its projected KV =
    used + promised (deflected backlog, incoming keeps) + this prompt.
    """

    models: LatencyModels
    config: alg.DeciderConfig
    mode: str = "isl"
    isl_tokens: int = 2048
    isl_ratio: float = 0.7
    prefill_busy: float = 4.0
    kv_busy: float | None = 0.5  # None: the guard is off
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        kv = "off" if self.kv_busy is None else f"{self.kv_busy:g}"
        return (
            f"dynamo(mode={self.mode},isl={self.isl_tokens},ratio={self.isl_ratio:g},busy={self.prefill_busy:g},"
            f"kv={kv}{chunk_label(self.chunk_tokens)})"
        )

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        effective = prompt_tokens  # cache-blind here (see above)
        isl = (
            self.mode in ("isl", "either")
            and effective < self.isl_tokens
            and effective / prompt_tokens < self.isl_ratio
        )
        load = False
        if self.mode in ("load", "either"):
            prefill, _ = alg.best_prefill_node(self.models, view, now, self.config, prompt_tokens)
            load = prefill.outstanding_tokens > self.prefill_busy * prefill.chunk_tokens
        if not (isl or load):
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_DYNAMO_RULE)
        node = alg.pick_keep_decode_node(self.models, view, now, self.config, prompt_tokens)
        if self.kv_busy is not None:
            projected = node.kv_capacity_tokens - node.free_kv_tokens + prompt_tokens
            if projected > self.kv_busy * node.kv_capacity_tokens:
                return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_DYNAMO_KV_GUARD)
        if not can_prefill_locally(node, now, self.config, prompt_tokens, self.chunk_tokens):
            return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        reason = Reason.DEFLECT_DYNAMO_ISL if isl else Reason.DEFLECT_DYNAMO_LOAD
        return prefill_locally(self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, reason)


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig) -> DynamoPolicy:
    def default(field: str) -> Any:
        return field_default(DynamoPolicy, field)

    chunk = chunk_param(spec, DynamoPolicy)
    mode = spec.get("mode", default("mode")).lower()
    if mode not in DYNAMO_MODES:
        raise spec.error(f"mode={mode!r} must be one of {list(DYNAMO_MODES)}")
    isl = spec.integer("isl", default("isl_tokens"))
    if isl < 0:
        raise spec.error(f"isl={isl} must be >= 0")
    kv_off = spec.get("kv", "").lower() == "off"
    kv = None if kv_off else spec.bounded("kv", default("kv_busy"), 0, 1)
    ratio = spec.bounded("ratio", default("isl_ratio"), 0, 1)
    busy = spec.bounded("busy", default("prefill_busy"), 0, math.inf)
    return DynamoPolicy(models, base, mode, isl, ratio, busy, kv, chunk)


register(
    "dynamo",
    build,
    {"mode": "|".join(DYNAMO_MODES), "isl": "N", "ratio": "R", "busy": "F", "kv": "F|off", "chunk": "N"},
)
