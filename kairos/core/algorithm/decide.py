"""Algorithm 1 (``decide``): keep on the best prefill node or deflect to the decode node whose
TBT-safe schedule gives the lowest TTFT, and its degraded mode while no prefill node is fresh
(``decide_without_prefill_pool``)."""

from __future__ import annotations

from collections.abc import Mapping

from kairos.common.errors import InvalidRequestError, NoHealthyNodeError
from kairos.core.algorithm.config import DeciderConfig, keep_step_budget_s, with_request_slo
from kairos.core.algorithm.eligibility import (
    best_prefill_node,
    cached_prefix,
    decode_pressure_refusal,
    deflection_gate_open,
    is_fresh,
    scan_decode_nodes,
)
from kairos.core.algorithm.keep_estimate import keep_ttft_s
from kairos.core.algorithm.schedule import expand_runs
from kairos.core.algorithm.search import best_deflection
from kairos.core.algorithm.split import SplitPlan, best_split
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.slo import RequestSLO
from kairos.core.state import ClusterView


def validate_prompt(prompt_tokens: int) -> None:
    if prompt_tokens < 1:
        raise InvalidRequestError(f"the prompt has {prompt_tokens} tokens; at least 1 is needed")


def decide(
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    models: LatencyModels,
    config: DeciderConfig,
    cached: Mapping[str, int] | None = None,
    slo: RequestSLO | None = None,
) -> Decision:
    """Algorithm 1: keep on the best prefill node, or deflect to the decode node whose
    TBT-safe greedy schedule gives the lowest TTFT, when Eq. 7 holds against the keep path's
    TTFT estimate (``keep_ttft_s``: Eq. 1 and the KV hand-off to the keep path's decode node)
    and the keep path's TTFT is not under the gate's share of the SLO (``deflection_gate_open``).

    ``cached``: the prompt tokens each node (by id) has cached, when known. Then every path
    prefills only the node's uncached tokens: Eq. 3 on prefill node p starts from its prefix
    h_p, the schedule on decode node d covers l - h_d tokens each step over the h_d cached, and
    the keep path's decode node weighs the transfer of the blocks it lacks. None (or no hit
    anywhere) is the paper's decision, to the bit.

    ``slo``: the request's own SLOs (None: the cluster's, ``config``'s). Its TTFT SLO is Eq. 7's
    bound (and the gate's and the pressure rule's), its TPOT SLO Eq. 5's tau, tightened on each
    decode node by the node's tightest TPOT in flight (``node_step_budget_s``): a batch request
    plans an interactive node's steps to the interactive tau, an interactive request any node's
    to its own."""
    validate_prompt(prompt_tokens)
    config = with_request_slo(config, slo)
    prefill_node, prefill_s = best_prefill_node(models, view, now, config, prompt_tokens, cached)
    keep_decode, eligible, facts, any_can_take = scan_decode_nodes(models, view, now, config, prompt_tokens, cached)
    keep_hit = cached_prefix(cached, keep_decode.node_id, prompt_tokens)
    ttft_pf = keep_ttft_s(models, config, prefill_s, keep_decode, prompt_tokens, keep_hit, now)
    refused = decode_pressure_refusal(models, config, prompt_tokens, ttft_pf)

    def keep(reason: Reason, ttft_dec: float | None) -> Decision:
        return Decision(
            route=Route.KEEP,
            reason=reason,
            decode_node=keep_decode.node_id,
            prefill_node=prefill_node.node_id,
            chunk_sizes=(),
            predicted_ttft_prefill_s=ttft_pf,
            predicted_ttft_decode_s=ttft_dec,
            prompt_tokens=prompt_tokens,
            predicted_prefill_end_s=prefill_s,
            cached_tokens=cached_prefix(cached, prefill_node.node_id, prompt_tokens),
            step_budget_s=keep_step_budget_s(config, keep_decode),
            slo=slo,
        )

    if not eligible:
        if any_can_take:
            return keep(Reason.KEEP_DECODE_OVERLOADED, None)
        return keep(Reason.KEEP_NO_ELIGIBLE_DECODE, None)
    if refused is not None and all(map(refused, eligible)):  # stops at the first node let through
        return keep(Reason.KEEP_DECODE_OVERLOADED, None)
    if not deflection_gate_open(config, ttft_pf):
        return keep(Reason.KEEP_SLO_ROOM, None)

    margin_s = config.alpha * ttft_pf
    bound = min(margin_s, config.ttft_slo_s)
    best, any_too_slow = best_deflection(models, config, eligible, prompt_tokens, bound, facts, cached, refused, now)

    def split_or_keep(reason: Reason, ttft_dec: float | None) -> Decision:
        """No deflection meets Eq. 7: a split that does (``best_split``), else the keep."""
        found = best_split(models, config, prefill_node, eligible, prompt_tokens, bound, ttft_pf, cached, refused, now)
        if found is None:
            return keep(reason, ttft_dec)
        return _split(found, prefill_node.node_id, ttft_pf, prompt_tokens, config, cached, slo)

    if best is None:
        if not any_too_slow:
            return split_or_keep(Reason.KEEP_NO_SAFE_SCHEDULE, None)
        slower = margin_s <= config.ttft_slo_s
        return split_or_keep(Reason.KEEP_DECODE_SLOWER if slower else Reason.KEEP_DECODE_OVER_SLO, None)

    ttft_dec, node_id, plan = best
    if ttft_dec > margin_s:
        return split_or_keep(Reason.KEEP_DECODE_SLOWER, ttft_dec)
    if ttft_dec > config.ttft_slo_s:
        return split_or_keep(Reason.KEEP_DECODE_OVER_SLO, ttft_dec)
    sizes, times = expand_runs(plan.runs)
    return _deflect(
        Reason.DEFLECT_WITHIN_MARGIN,
        node_id,
        sizes,
        times,
        plan.decode_tokens,
        ttft_pf,
        ttft_dec,
        prompt_tokens,
        config,
        plan.step_budget_s,
        cached_prefix(cached, node_id, prompt_tokens),
        slo,
    )


def decide_without_prefill_pool(
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    models: LatencyModels,
    config: DeciderConfig,
    slo: RequestSLO | None = None,
) -> Decision:
    """Degraded routing while no fresh prefill node is registered (all dead, or their heartbeats
    lost on a starved host): a decode node prefills the request itself rather than the request
    failing, within the bounds a deflection has on the normal path. A candidate is fresh, has KV
    room for the prompt, is under the pending-deflection limit and under its overload line
    (``scan_decode_nodes``); its schedule keeps every step within the node's step budget (Eq. 5)
    and finishes within the TTFT SLO (Eq. 7's second clause: with no prefill path there is no
    alpha clause, nor a keep path for the gate or the pressure rule to weigh). The fastest such
    node wins. When none qualifies: :class:`NoHealthyNodeError` (a 503) that says which bound held
    the nodes back, rather than a schedule no bound holds. ``slo``: the request's own SLOs, as
    in ``decide``."""
    validate_prompt(prompt_tokens)
    config = with_request_slo(config, slo)
    if not view.decode:
        raise NoHealthyNodeError("no prefill or decode node is registered")
    _, eligible, facts, any_can_take = scan_decode_nodes(models, view, now, config, prompt_tokens)
    bound = config.ttft_slo_s
    best, any_too_slow = best_deflection(models, config, eligible, prompt_tokens, bound, facts, now=now)
    if best is None:
        if not any(is_fresh(n.reported_at, now, config) for n in view.decode):
            why = "no decode node is fresh either"
        elif any_can_take and not eligible:
            why = "every decode node with room for it is over its overload line (its decode-only step)"
        elif not eligible:
            why = "no fresh decode node has room for it (its KV, and a deflection slot under the pending limit)"
        elif any_too_slow:
            why = f"no decode node can prefill it within the TTFT SLO ({config.ttft_slo_s:g} s)"
        else:
            why = "no decode node has a TBT-safe schedule for it (every step within its step budget)"
        raise NoHealthyNodeError(
            f"no prefill node is available to prefill this {prompt_tokens}-token prompt, and {why}"
        )
    ttft_dec, node_id, plan = best
    sizes, times = expand_runs(plan.runs)
    return _deflect(
        Reason.DEFLECT_NO_PREFILL_NODE,
        node_id,
        sizes,
        times,
        plan.decode_tokens,
        None,
        ttft_dec,
        prompt_tokens,
        config,
        plan.step_budget_s,
        slo=slo,
    )


def _split(
    found: SplitPlan,
    prefill_node: str,
    ttft_pf: float,
    prompt_tokens: int,
    config: DeciderConfig,
    cached: Mapping[str, int] | None,
    slo: RequestSLO | None,
) -> Decision:
    """A split: the prefill node prefills the prompt's first k tokens (of which it caches
    ``cached_tokens``), the decode node the rest by its schedule, within the step budget it was
    planned to (as a deflection's)."""
    plan = found.plan
    sizes, times = expand_runs(plan.runs)
    return Decision(
        route=Route.SPLIT,
        reason=Reason.SPLIT_WITHIN_MARGIN,
        decode_node=found.node_id,
        prefill_node=prefill_node,
        chunk_sizes=tuple(sizes),
        predicted_ttft_prefill_s=ttft_pf,
        predicted_ttft_decode_s=plan.ttft_s,
        prompt_tokens=prompt_tokens,
        step_budget_s=plan.step_budget_s if config.node_step_guard else None,
        predicted_step_s=tuple(times),
        planned_decode_tokens=plan.decode_tokens,
        predicted_prefill_end_s=found.prefill_end_s,
        cached_tokens=cached_prefix(cached, prefill_node, found.split_tokens),
        slo=slo,
        split_tokens=found.split_tokens,
    )


def _deflect(
    reason: Reason,
    node_id: str,
    sizes: list[int],
    times: list[float],
    decode_tokens: int,
    ttft_pf: float | None,
    ttft_dec: float | None,
    prompt_tokens: int,
    config: DeciderConfig,
    step_budget_s: float,
    cached_tokens: int = 0,
    slo: RequestSLO | None = None,
) -> Decision:
    """A deflection to ``node_id`` with its schedule, carrying the step budget the node enforces
    (the one it was planned to, ``node_step_budget_s``: a node that knows its decodes' TPOTs
    tightens it further by theirs, ``kairos.core.slo.tau_scaled_budget_s``)."""
    return Decision(
        route=Route.DEFLECT,
        reason=reason,
        decode_node=node_id,
        prefill_node=None,
        chunk_sizes=tuple(sizes),
        predicted_ttft_prefill_s=ttft_pf,
        predicted_ttft_decode_s=ttft_dec,
        prompt_tokens=prompt_tokens,
        step_budget_s=step_budget_s if config.node_step_guard else None,
        predicted_step_s=tuple(times),
        planned_decode_tokens=decode_tokens,
        cached_tokens=cached_tokens,
        slo=slo,
    )
