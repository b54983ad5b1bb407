"""The deflection search (§4.4): among the eligible decode nodes, the one whose TBT-safe schedule
gives the lowest TTFT within a bound, each node's schedule search abandoned once it cannot win;
in id order, or lowest TTFT lower bound first (``search_bounded``) where the profile allows one."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from kairos.core.algorithm.bounds import BOUND_SLACK, NodeFacts, lower_bound_from_facts, plan_on_path
from kairos.core.algorithm.config import DeciderConfig
from kairos.core.algorithm.eligibility import cached_prefix
from kairos.core.algorithm.schedule import TOO_SLOW, Plan, plan_on_decode_node, planning_batch
from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState

# Fewer eligible decode nodes than this are searched in id order: the bound could spare a
# schedule search or two, and costs a greedy path for every node state it has not seen.
BOUNDED_SEARCH_MIN_NODES = 4


# The deflection search: the decode node whose schedule gives the lowest TTFT within ``bound``,
# the lowest node id on a tie (then the first in the view), and whether any node's schedule
# was abandoned for running past the bound (rather than finding no TBT-safe chunk).
Best = tuple[float, str, Plan]
_PlanMemo = dict[
    tuple[int, int, tuple[int, ...], tuple[int, ...], int, float, float | None, float | None, float | None, int],
    "Plan | str",
]


def _cutoff(limit_s: float) -> float:
    """A lower bound above this says for sure that the schedule's TTFT, as computed, is above
    ``limit_s``."""
    return limit_s + abs(limit_s) * BOUND_SLACK


def _memo_plan(
    memo: _PlanMemo,
    planner: Callable[[LatencyModels, DeciderConfig, DecodeNodeState, int, float, int, float | None], Plan | str],
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up: float,
    cached_tokens: int = 0,
    now: float | None = None,
) -> Plan | str:
    """``planner`` (``plan_on_decode_node`` or its equal), once per distinct node state (and
    cached prefix) in a search. Bounds only tighten during a search, and a schedule too slow for
    a looser bound is too slow for a tighter one. A node that says how long its step had run is
    planned from its heartbeat's time too (``start_shift_s``)."""
    elapsed = node.running_step_elapsed_s
    key = (
        *planning_batch(config, node),
        node.prefill_backlog_tokens,
        node.prefill_backlog_computed_tokens,
        node.overlay_backlog,
        node.step_calibration,
        node.tpot_slo_s,
        elapsed,
        None if elapsed is None else node.reported_at,
        cached_tokens,
    )
    plan = memo.get(key)
    if plan is None:
        plan = memo[key] = planner(models, config, node, prompt_tokens, give_up, cached_tokens, now)
    return plan


def search_in_id_order(
    models: LatencyModels,
    config: DeciderConfig,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
    now: float | None = None,
) -> tuple[Best | None, bool]:
    """Every node in id order, each schedule search abandoned once slower than both the bound
    and the best node so far (§4.4); none that ``refused`` (the decode pressure rule) refuses.
    The search for profiles ``search_bounded`` cannot bound."""
    best: Best | None = None
    any_too_slow = False
    memo: _PlanMemo = {}
    for node in sorted(eligible, key=lambda n: n.node_id):
        if refused is not None and refused(node):
            continue
        give_up = bound if best is None else min(bound, best[0])
        hit = cached_prefix(cached, node.node_id, prompt_tokens) if cached else 0
        plan = _memo_plan(memo, plan_on_decode_node, models, config, node, prompt_tokens, give_up, hit, now)
        if plan == TOO_SLOW:
            any_too_slow = True
        elif isinstance(plan, Plan) and (best is None or plan.ttft_s < best[0]):
            best = (plan.ttft_s, node.node_id, plan)
    return best, any_too_slow


def search_bounded(
    models: LatencyModels,
    config: DeciderConfig,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    facts: list[NodeFacts],
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
    now: float | None = None,
) -> tuple[Best | None, bool]:
    """``search_in_id_order``'s result, visiting only the nodes whose TTFT lower bound
    (``ttft_lower_bound_s``) can still beat the best so far, lowest bound first, and asking
    ``refused`` only of those.

    The same winner: it is the least (TTFT, node id, place in the view) among the nodes whose
    schedule fits the bound, and a node is skipped only when its bound, hence its TTFT, is above
    the best so far (or the bound). The same reason when none fits: a node skipped for the bound
    is searched after all if no node searched ran past it. ``facts``: each eligible node's. A
    node with a cached prefix has no such bound (its schedule leaves the node's path): 0, so it
    is always searched."""
    beyond: list[DecodeNodeState] = []  # cannot finish within the bound
    order: list[tuple[float, str, int, DecodeNodeState]] = []
    limit, cutoff = bound, _cutoff(bound)
    lower_bound = lower_bound_from_facts
    for i, node in enumerate(eligible):
        hit = cached_prefix(cached, node.node_id, prompt_tokens) if cached else 0
        lb = 0.0 if hit else lower_bound(facts[i], node, prompt_tokens, now)
        if lb > cutoff:
            beyond.append(node)
        else:
            order.append((lb, node.node_id, i, node))
    heapq.heapify(order)
    best: tuple[float, str, int, Plan] | None = None
    any_too_slow = False
    memo: _PlanMemo = {}
    while order:
        lb, node_id, i, node = heapq.heappop(order)
        if lb > cutoff:
            break  # every node left has a bound at least this high
        if refused is not None and refused(node):
            continue
        hit = cached_prefix(cached, node_id, prompt_tokens) if cached else 0
        plan = _memo_plan(memo, plan_on_path, models, config, node, prompt_tokens, limit, hit, now)
        if plan == TOO_SLOW:
            any_too_slow = True
        elif isinstance(plan, Plan) and (best is None or (plan.ttft_s, node_id, i) < best[:3]):
            best = (plan.ttft_s, node_id, i, plan)
            limit = min(bound, plan.ttft_s)
            cutoff = _cutoff(limit)
    if best is None:
        any_too_slow = any_too_slow or any(
            _memo_plan(memo, plan_on_path, models, config, node, prompt_tokens, bound, 0, now) == TOO_SLOW
            for node in beyond  # no cached prefix there: those nodes had a bound
            if refused is None or not refused(node)
        )
        return None, any_too_slow
    return (best[0], best[1], best[3]), any_too_slow


def best_deflection(
    models: LatencyModels,
    config: DeciderConfig,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    facts: list[NodeFacts],
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
    now: float | None = None,
) -> tuple[Best | None, bool]:
    """The deflection search's result (``Best``, or None when no node's schedule fits ``bound``)
    and whether any node's schedule ran past the bound: ``search_bounded`` where the profile
    allows a lower bound and the nodes are enough to pay for it, else ``search_in_id_order``. TTFTs
    from ``now`` (None: from each node's heartbeat)."""
    if models.mixed_nonnegative and len(eligible) >= BOUNDED_SEARCH_MIN_NODES:
        return search_bounded(models, config, eligible, prompt_tokens, bound, facts, cached, refused, now)
    return search_in_id_order(models, config, eligible, prompt_tokens, bound, cached, refused, now)
