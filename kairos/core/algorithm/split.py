"""The split route: the prompt's first k tokens on a prefill node, the rest on a decode node.

A split sits between the paper's two routes. The prefill node prefills the prompt's first k
tokens (Eq. 1 over k: ``keep_prefill_s``), the decode node pulls their KV (the link queue, the
transfer of the blocks it lacks and the admission wait of the keep path: ``kv_landing_s``), then
prefills the other l - k tokens itself, as a TBT-safe greedy chunk schedule beside its decodes
(Eqs. 4-6 over the k tokens it now holds), from its first step boundary after both its backlog
and the KV's landing. So for decode node d, with the prefill node p the keep path would take:

    TTFT_split(k, d) = max(start_d, T_pf(k) + T_land(k, d) + W_join) + sum_j T(chi_j)   (Eq. 6 over l - k)

with k = l the keep path (Eq. 1 + hand-off) and k = h_d, the decode node's own prefix hit, the
deflection (Eq. 6 alone). k runs over a grid of block-aligned points strictly between those ends
(``split_points``). Which k (``DeciderConfig.split``):

- ``offload``: the smallest k, the most prefill taken off the prefill pool, whose TTFT meets
  Eq. 7's bound, min(alpha x TTFT_pf, SLO): the deflection's rule for the part of the prompt it
  moves. With alpha = 1 the request is predicted no slower than on the keep path, and every token
  moved shortens the prefill queue for the requests behind it.
- ``fastest``: the k of the lowest predicted TTFT, taken only when it beats the keep path's.

Among decode nodes: the smallest k, then the lowest TTFT, then the lowest node id."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kairos.core.algorithm.bounds import BOUND_SLACK
from kairos.core.algorithm.config import DeciderConfig, node_step_budget_s
from kairos.core.algorithm.eligibility import cached_prefix
from kairos.core.algorithm.keep_estimate import join_wait_s, kv_landing_s
from kairos.core.algorithm.prefill_estimate import keep_prefill_s
from kairos.core.algorithm.schedule import (
    INFEASIBLE,
    TOO_SLOW,
    Plan,
    StepTable,
    backlog_end,
    greedy_steps,
    start_shift_s,
    step_table,
)
from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState, PrefillNodeState


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """The split a decision found: its decode node, k, the prefill end of the k tokens (from
    now) and the decode node's schedule of the rest (its ``ttft_s``: the split's TTFT)."""

    node_id: str
    split_tokens: int
    prefill_end_s: float
    plan: Plan


def split_points(prompt_tokens: int, floor_tokens: int, grid: int, block_tokens: int) -> list[int]:
    """The k a split may take, ascending: ``grid`` - 1 cuts of the tokens above ``floor_tokens``
    (the decode node's cached prefix) into equal parts, each rounded down to a whole KV block
    (vLLM hands KV over in blocks; a partial last block would be computed twice), strictly between
    ``floor_tokens`` and the prompt's end."""
    span = prompt_tokens - floor_tokens
    points: list[int] = []
    for j in range(1, grid):
        k = (floor_tokens + span * j // grid) // block_tokens * block_tokens
        if floor_tokens < k < prompt_tokens and (not points or k > points[-1]):
            points.append(k)
    return points


class _NodeTail:
    """One decode node's side of the k search: where the node could start a new request's own
    steps (``backlog_end``, shifted to ``now`` as ``plan_on_decode_node`` does), and the rest's
    schedule for each k, its Eq. 4 table built once per batch it runs beside."""

    __slots__ = ("b", "budget", "config", "k", "models", "node", "now", "shift", "start", "tables")

    def __init__(self, models: LatencyModels, config: DeciderConfig, node: DecodeNodeState, now: float | None) -> None:
        self.models, self.config, self.node, self.now = models, config, node, now
        b, k, t = backlog_end(models, config, node)
        self.b, self.k = b, k
        self.start: float | None = None if isinstance(t, str) else t  # None: the backlog has no schedule
        self.shift = 0.0 if self.start is None else start_shift_s(models, config, node, self.start, now)
        self.budget = node_step_budget_s(config, node)
        self.tables: dict[tuple[int, int], StepTable] = {}

    def plan(self, prompt_tokens: int, split_tokens: int, lands_s: float, give_up_after_s: float) -> Plan | str:
        """The schedule of the prompt after its first ``split_tokens``, whose KV lands ``lands_s``
        from now: from the node's first step boundary after its backlog and the landing (a landing
        mid-step waits for the step's end: ``join_wait_s``). The node runs its scheduled prefills
        in the order they reach it; none reaches it meanwhile, for the view holds the rest in the
        node's backlog from the decision until a heartbeat after the landing, which bars the node
        to other deflections and splits under the pending limit."""
        assert self.start is not None
        models, node = self.models, self.node
        b, k, shift = self.b, self.k, self.shift
        begin = self.start - shift  # from now
        if lands_s > begin:
            # The keeps on their way to the node join its batch before the rest starts, most of
            # them: their prefills are ahead of this one's first k in the prefill queues.
            b, k = b + node.incoming_keeps, k + node.incoming_keep_tokens
            if node.decode_tokens > 0 or b > 0:
                begin = lands_s + join_wait_s(models, node, models.decode_step_s(b, k), lands_s, self.now)
            else:
                begin = lands_s
        table = self.tables.get((b, k))
        if table is None:
            table = self.tables[(b, k)] = step_table(models, b, k, self.config.chunk_candidates)
        rest = prompt_tokens - split_tokens
        if models.mixed_nonnegative:
            # No schedule of the rest beats its steps at their least: each over the k tokens
            # pulled, as few as its largest chunk allows (ttft_lower_bound_s's argument).
            a0, a_c, b0, b1 = table[:4]
            largest = table[6][0]
            if largest <= 0:
                return INFEASIBLE
            least = -(-rest // largest) * (a0 + a_c * split_tokens) + rest * (b0 + b1 * split_tokens)
            if begin + least > give_up_after_s * (1 + BOUND_SLACK):
                return TOO_SLOW
        done = greedy_steps(
            table,
            b,
            models.mixed_monotone,
            self.budget,
            give_up_after_s + shift,
            rest,
            split_tokens,
            0,
            begin + shift,
            [],
        )
        if isinstance(done, str):
            return done
        return Plan(decode_tokens=b, runs=tuple(done[0]), ttft_s=done[1] - shift, step_budget_s=self.budget)


def best_split(
    models: LatencyModels,
    config: DeciderConfig,
    prefill_node: PrefillNodeState,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    keep_ttft_s: float,
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
    now: float | None = None,
) -> SplitPlan | None:
    """The split ``config.split`` picks (see the module docstring) across the eligible decode
    nodes, with prefill node ``prefill_node``; None when no k meets the rule. ``bound``: Eq. 7's,
    min(alpha x TTFT_pf, SLO); ``keep_ttft_s``: the keep path's TTFT (``fastest`` must beat it)."""
    mode = config.split
    if mode == "off":
        return None
    block = config.kv_block_tokens
    prefill_hit = cached_prefix(cached, prefill_node.node_id, prompt_tokens) if cached else 0
    prefill_end: dict[int, float] = {}  # k -> the k tokens' prefill end, shared by the nodes
    limit = bound if mode == "offload" else min(bound, keep_ttft_s)
    best: tuple[int, float, str, SplitPlan] | None = None
    # The prefill of a split's first k grows with k: where even one block's is past the bound (a
    # saturated prefill pool), no split qualifies on any node, and no node is looked at.
    if keep_prefill_s(models, config, prefill_node, block, min(prefill_hit, block), now) >= limit:
        return None
    for node in eligible:
        if refused is not None and refused(node):
            continue
        hit = cached_prefix(cached, node.node_id, prompt_tokens) if cached else 0
        points = split_points(prompt_tokens, hit, config.split_points, block)
        if not points:
            continue
        tail: _NodeTail | None = None  # built for the first k whose prefill leaves room
        # offload: from the prompt's end down, k shrinks while the split meets the bound (its
        # prefill alone past the bound leaves room for a smaller k; its rest past it ends the walk,
        # a smaller k only gives the node more). fastest: every k.
        for k in reversed(points) if mode == "offload" else points:
            end = prefill_end.get(k)
            if end is None:
                end = prefill_end[k] = keep_prefill_s(models, config, prefill_node, k, min(prefill_hit, k), now)
            if end >= limit:
                continue
            if tail is None:
                tail = _NodeTail(models, config, node, now)
            if tail.start is None:
                break  # the node's backlog has no schedule
            lands = end + kv_landing_s(models, config, node, prompt_tokens, k, end, hit, now)
            give_up = limit if best is None or mode == "offload" else min(limit, best[1])
            plan = tail.plan(prompt_tokens, k, lands, give_up)
            if isinstance(plan, str) or plan.ttft_s > limit:
                if mode == "offload":
                    break
                continue
            key = (k, plan.ttft_s, node.node_id) if mode == "offload" else (0, plan.ttft_s, node.node_id)
            if best is None or key < best[:3]:
                best = (*key, SplitPlan(node.node_id, k, end, plan))
    return None if best is None else best[3]
