"""Node eligibility and the keep path's choices: which decode nodes may take a deflection (fresh,
room, the pending limit, the overload line, the decode pressure rule, the deflection gate), the
keep path's decode node and its best prefill node."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from kairos.common.errors import NoHealthyNodeError
from kairos.core.algorithm.bounds import NodeFacts, node_facts
from kairos.core.algorithm.config import DeciderConfig, tau_share
from kairos.core.algorithm.decode_load import decode_load_after_s
from kairos.core.algorithm.prefill_estimate import packed_prefill_s, prefill_exec_s, prefill_queue_wait_s
from kairos.core.latency import LatencyModels
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState


def is_fresh(reported_at: float, now: float, config: DeciderConfig) -> bool:
    return now - reported_at <= config.stale_after_s


def can_take_deflection(node: DecodeNodeState, now: float, config: DeciderConfig, prompt_tokens: int) -> bool:
    """Fresh heartbeat, room for the prompt's KV, and under the pending-deflection limit."""
    if not is_fresh(node.reported_at, now, config) or node.free_kv_tokens < prompt_tokens:
        return False
    limit = config.max_pending_deflections
    return limit is None or len(node.prefill_backlog_tokens) < limit


def decode_pressure_refusal(
    models: LatencyModels, config: DeciderConfig, prompt_tokens: int, ttft_pf: float
) -> Callable[[DecodeNodeState], bool] | None:
    """The decode pressure rule for one request: None where it does not apply, else whether it
    refuses a deflection candidate. While the keep path's TTFT ``ttft_pf`` meets the SLO, it
    refuses a node whose decode-only step with the request joined is over
    ``decode_pressure_share`` of the overload line. The request decodes on some decode node
    either way; its chunks would lengthen the steps of a node whose own decodes already near
    tau, to save part of a TTFT that needs no saving. When the keep path misses the SLO, the
    deflection can still rescue the request, and no candidate is refused.

    The line is a share of ``config.decode_overload_s``, not of the node's calibrated one: the
    rule is about P/D's own decodes nearing tau on batch swings, and the model's error has its
    margin already, in the calibrated overload line and step budget. Divided by the calibration
    too, the error counted twice: at a 10% step error (a 99th-percentile ratio near 1.29) the line
    fell to 46 ms, under Bursty's 48 ms decode-only steps, and refused nearly every deflection
    (``bench/sim/calibration.py``). With no error (calibration 1) nothing changes. It is taken at
    the node's tau (its tightest TPOT in flight, when tighter than the request's), as the
    overload line is.

    A predicate, asked of the candidates the search reaches, rather than a filter over all of
    them: the bounded search plans a few of a thousand nodes, and a refused node skipped where
    it would be planned leaves the same winner as its absence."""
    share = config.decode_pressure_share
    if share is None or not config.decode_overload_guard or ttft_pf > config.ttft_slo_s:
        return None
    line_s = share * config.decode_overload_s

    def refuses(node: DecodeNodeState) -> bool:
        return decode_load_after_s(models, node, prompt_tokens) > line_s * tau_share(config, node)

    return refuses


def deflection_gate_open(config: DeciderConfig, ttft_pf: float) -> bool:
    """May a deflection be weighed at all for a request whose keep path's TTFT estimate is
    ``ttft_pf``? Only from ``deflect_gate_share`` of the TTFT SLO on (always when None, the
    paper). Below it the keep path meets the SLO with room: a deflection would shave a TTFT that
    needs no saving, and its chunks lengthen the steps of the decodes beside them on a node that
    P/D leaves to its decodes, a TBT cost the requests already there pay (never worse than P/D).
    From the line on, the keep path's queue is what Eq. 7 weighs a deflection against."""
    share = config.deflect_gate_share
    return share is None or ttft_pf >= share * config.ttft_slo_s


def pick_keep_decode_node(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> DecodeNodeState:
    """Least-loaded decode node for the P/D path: fresh nodes first, then nodes with room
    for the prompt's KV; ties broken by node id so the choice is deterministic. With the
    nodes' cached prefixes (``cached``, tokens by node id), the load is weighed with the
    transfer of the blocks each node lacks: a node that holds the conversation takes its next
    turn unless its decode steps are slower by more than the transfer it saves."""
    if not view.decode:
        raise NoHealthyNodeError("no decode node is registered")
    fresh = [n for n in view.decode if is_fresh(n.reported_at, now, config)] or list(view.decode)
    roomy = [n for n in fresh if n.free_kv_tokens >= prompt_tokens] or fresh
    hits = [cached_prefix(cached, n.node_id, prompt_tokens) for n in roomy] if cached else ()
    if any(hits):
        return min(
            zip(roomy, hits, strict=True),
            key=lambda nh: (
                node_facts(models, config, nh[0]).load_s + models.kv_transfer_s(prompt_tokens - nh[1]),
                nh[0].node_id,
            ),
        )[0]
    return min(roomy, key=lambda n: (node_facts(models, config, n).load_s, n.node_id))  # load_s = decode_load_s


def cached_prefix(cached: Mapping[str, int] | None, node_id: str, prompt_tokens: int) -> int:
    """The prompt tokens ``node_id`` has cached (0 when unknown), at most all but the last one,
    which a node always computes."""
    if not cached:
        return 0
    return max(0, min(cached.get(node_id, 0), prompt_tokens - 1))


def best_prefill_node(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> tuple[PrefillNodeState, float]:
    """The prefill node with the lowest prefill end (fresh nodes first), and that time: Eq. 1
    with ``keep_estimate="eq1"``, else ``packed_prefill_s``; with the nodes' cached prefixes
    (``cached``, tokens by node id) each node's covers its uncached tokens."""
    if not view.prefill:
        raise NoHealthyNodeError("no prefill node is registered")
    fresh = [n for n in view.prefill if is_fresh(n.reported_at, now, config)] or list(view.prefill)
    best: tuple[float, str, PrefillNodeState] | None = None
    if config.keep_estimate != "eq1":
        for n in fresh:
            hit = cached_prefix(cached, n.node_id, prompt_tokens) if cached else 0
            end = packed_prefill_s(models, n, prompt_tokens, hit, now)
            if best is None or (end, n.node_id) < best[:2]:
                best = (end, n.node_id, n)
        assert best is not None  # view.prefill is not empty
        return best[2], best[0]
    exec_s: dict[tuple[int, int], float] = {}  # Eq. 3 depends on the node only through its chunk size and hit
    for n in fresh:
        key = (n.chunk_tokens, cached_prefix(cached, n.node_id, prompt_tokens) if cached else 0)
        own = exec_s.get(key)
        if own is None:
            own = exec_s[key] = prefill_exec_s(models, prompt_tokens, n.chunk_tokens, key[1])
        ttft = prefill_queue_wait_s(models, n) + own  # = prefill_ttft_s, to the bit
        if best is None or (ttft, n.node_id) < best[:2]:
            best = (ttft, n.node_id, n)
    assert best is not None  # view.prefill is not empty
    return best[2], best[0]


def scan_decode_nodes(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> tuple[DecodeNodeState, list[DecodeNodeState], list[NodeFacts], bool]:
    """One pass over the decode nodes for ``decide``: the keep path's node
    (``pick_keep_decode_node``), the deflection candidates in view order with their facts, and
    whether any node could take a deflection but for the overload line.

    A candidate can take the deflection (``can_take_deflection``) and is not overloaded: the
    schedule search plans on the heartbeat's B alone, so it can still find a chunk for a node
    that the decodes on their way to it (backlog, incoming keeps) will push over the overload
    line; P/D would leave that node to its decodes (never worse than P/D). At 1,000 nodes this
    pass is a third of a decision: it reads each node's facts once."""
    if not view.decode:
        raise NoHealthyNodeError("no decode node is registered")
    guard = config.decode_overload_guard
    stale_after, limit = config.stale_after_s, config.max_pending_deflections
    eligible: list[DecodeNodeState] = []
    facts: list[NodeFacts] = []
    any_can_take = False
    keep: DecodeNodeState | None = None  # least (load, id) among fresh nodes with room
    keep_load = math.inf
    any_fresh = False
    for n in view.decode:
        if now - n.reported_at > stale_after:  # is_fresh
            continue
        any_fresh = True
        if n.free_kv_tokens < prompt_tokens:
            continue
        f = n.derived
        if type(f) is not NodeFacts or f.models is not models or not (f.config is config or f.config == config):
            f = node_facts(models, config, n)
        load = f.load_s
        if keep is None or load < keep_load or (load == keep_load and n.node_id < keep.node_id):
            keep, keep_load = n, load
        if limit is None or len(n.prefill_backlog_tokens) < limit:
            any_can_take = True
            if not guard or load <= f.overload_s:  # the node's own line (its step calibration)
                eligible.append(n)
                facts.append(f)
    if keep is None or not any_fresh or cached:  # no fresh node with room, or cache hits to weigh
        keep = pick_keep_decode_node(models, view, now, config, prompt_tokens, cached)
    return keep, eligible, facts, any_can_take
