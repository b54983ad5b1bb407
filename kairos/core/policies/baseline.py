"""What the baselines share: P/D's keep route, and prefilling a whole request on a decode node.

The field's deciders (llmd.py, dynamo.py, aibrix.py) each decide keep or prefill-on-the-decode-
node with their own rule on what Kairos's heartbeats show; where the original reads a signal
Kairos does not have, the class docstring says what stands in for it. They do not read the
nodes' prefix caches here (only kairos, oracle and pd do), so a prompt's uncached ("effective")
length is its whole length, as on cache-cold traffic. A request they (or the static rules)
prefill on a decode node runs as vLLM's chunked prefill would run it there: a fixed token budget
per step (the decode nodes' max_num_batched_tokens), decodes first, the prompt filling the rest,
and no TBT guard, since none of them plans or bounds the steps it adds.
"""

from __future__ import annotations

from collections.abc import Mapping

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.policies.spec import PolicySpec, field_default
from kairos.core.state import ClusterView, DecodeNodeState


def keep(
    models: LatencyModels,
    cfg: alg.DeciderConfig,
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    reason: Reason,
    cached: Mapping[str, int] | None = None,
) -> Decision:
    """Plain P/D: the prefill node by Eq. 1, the decode node by the keep path's pick."""
    prefill, prefill_s = alg.best_prefill_node(models, view, now, cfg, prompt_tokens, cached)
    decode = alg.pick_keep_decode_node(models, view, now, cfg, prompt_tokens, cached)
    ttft_pf = alg.keep_ttft_s(
        models, cfg, prefill_s, decode, prompt_tokens, alg.cached_prefix(cached, decode.node_id, prompt_tokens), now
    )
    hit = alg.cached_prefix(cached, prefill.node_id, prompt_tokens)
    return Decision(
        Route.KEEP,
        reason,
        decode.node_id,
        prefill.node_id,
        (),
        ttft_pf,
        None,
        prompt_tokens,
        predicted_prefill_end_s=prefill_s,
        cached_tokens=hit,
        step_budget_s=alg.keep_step_budget_s(cfg, decode),
    )


def fixed_chunk_schedule(
    models: LatencyModels, decode_tokens: int, kv_tokens: int, prompt_tokens: int, step_tokens: int
) -> tuple[list[int], list[float]]:
    """A prompt prefilled the way a vLLM engine's chunked prefill does it with a token budget of
    ``step_tokens`` per step: the running decodes first, the prompt's next chunk fills the rest
    (chi - B tokens), whatever that does to the step time. Needs ``step_tokens > decode_tokens``."""
    sizes: list[int] = []
    times: list[float] = []
    room = step_tokens - decode_tokens
    cached = 0
    while cached < prompt_tokens:
        p = min(room, prompt_tokens - cached)
        sizes.append(p)
        times.append(models.mixed_step_s(decode_tokens + p, cached, decode_tokens, kv_tokens + cached))
        cached += p
    return sizes, times


def can_prefill_locally(
    node: DecodeNodeState, now: float, config: alg.DeciderConfig, prompt_tokens: int, step_tokens: int
) -> bool:
    """A decode node the gateway may hand a whole request to: fresh heartbeat, room for the
    prompt's KV, and a step budget its running decodes do not already fill."""
    return (
        alg.is_fresh(node.reported_at, now, config)
        and node.free_kv_tokens >= prompt_tokens
        and node.decode_tokens < step_tokens
    )


def prefill_locally(
    models: LatencyModels,
    config: alg.DeciderConfig,
    view: ClusterView,
    now: float,
    node: DecodeNodeState,
    prompt_tokens: int,
    step_tokens: int,
    reason: Reason,
) -> Decision:
    """Deflect to ``node`` with the fixed-budget schedule and no step guard (no baseline has one)."""
    sizes, times = fixed_chunk_schedule(models, node.decode_tokens, node.kv_tokens, prompt_tokens, step_tokens)
    _, ttft_pf = alg.best_prefill_node(models, view, now, config, prompt_tokens)
    return Decision(
        Route.DEFLECT,
        reason,
        node.node_id,
        None,
        tuple(sizes),
        ttft_pf,
        sum(times),
        prompt_tokens,
        predicted_step_s=tuple(times),
        planned_decode_tokens=node.decode_tokens,
    )


def chunk_label(chunk_tokens: int) -> str:
    """A label's ``,chunk=N``, shown only when it is not the decode nodes' step budget."""
    return "" if chunk_tokens == defaults.DECODE_STEP_TOKENS else f",chunk={chunk_tokens}"


def chunk_param(spec: PolicySpec, policy: type) -> int:
    """A field decider's ``chunk=``, its decode nodes' per-step token budget: ``policy``'s
    ``chunk_tokens`` default unless the spec sets one."""
    chunk = spec.integer("chunk", field_default(policy, "chunk_tokens"))
    if chunk < 2:
        raise spec.error(f"chunk={chunk} must be >= 2")
    return chunk
