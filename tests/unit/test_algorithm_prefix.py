"""Algorithm 1 with the nodes' cached prefixes: every path prefills only a node's uncached
tokens, and with no hit anywhere the decision is the paper's, to the bit."""

from __future__ import annotations

import itertools
import math

import pytest

from kairos.core import algorithm as alg
from kairos.core.algorithm import DeciderConfig, decide, greedy_schedule, prefill_exec_s
from kairos.core.algorithm.bounds import node_facts
from kairos.core.algorithm.schedule import Plan
from kairos.core.algorithm.search import search_bounded, search_in_id_order
from kairos.core.decision import Reason, Route
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.core.view import ClusterTracker
from tests.builders import decode_node, make_models, prefill_node, queue_load, view

CACHED_PREFILL = make_models(prefill_x_cached=1e-8)
PROFILE = load_profile()
CFG = DeciderConfig()


def test_eq3_over_a_cached_prefix_starts_from_it() -> None:
    # 1200 tokens, 1000 cached, chunk 512: one step of 200 over 1000 = 0.010 + 0.02 + 1e-8*200*1000
    assert prefill_exec_s(CACHED_PREFILL, 1200, 512, 1000) == pytest.approx(0.032)
    assert prefill_exec_s(CACHED_PREFILL, 1200, 512, 0) == prefill_exec_s(CACHED_PREFILL, 1200, 512)


def test_the_schedule_covers_the_uncached_tokens_over_the_cached_prefix() -> None:
    node = decode_node(b=40, k=300_000)
    plan = alg.plan_on_decode_node(PROFILE, CFG, node, 6000, math.inf, cached_tokens=5000)
    assert isinstance(plan, Plan)
    sizes, times = alg.expand_runs(plan.runs)
    assert sum(sizes) == 1000
    # Each step costed as Eq. 4 with the request's cached KV (prefix + chunks so far) on it.
    cached = 5000
    for p, t in zip(sizes, times, strict=True):
        assert t == pytest.approx(PROFILE.mixed_step_s(40 + p, cached, 40, 300_000 + cached))
        cached += p
    done = greedy_schedule(PROFILE, 6000, 40, 300_000, CFG.chunk_candidates, CFG.step_budget_s, cached_tokens=5000)
    running = PROFILE.decode_step_s(40, 300_000)  # the node's next step starts half of it from now
    assert not isinstance(done, str) and plan.ttft_s == pytest.approx(0.5 * running + done[1], rel=1e-12)


def states() -> list[tuple[tuple, tuple]]:
    prefills = [(prefill_node("p0", queue=q, chunk=2048), prefill_node("p1", queue=q2, chunk=2048))
                for q, q2 in [((), ()), ((20000,), (8000,)), ((60000,), (60000, 9000))]]  # fmt: skip
    decodes = [
        tuple(decode_node(f"d{i}", b=b, k=k) for i, (b, k) in enumerate(ds))
        for ds in [((0, 0), (10, 20000)), ((60, 200_000), (30, 90_000), (5, 4000), (120, 600_000))]
    ]
    return list(itertools.product(prefills, decodes))


@pytest.mark.parametrize("prompt", [300, 4000, 15000])
def test_no_hit_anywhere_is_the_papers_decision(prompt: int) -> None:
    for prefills, decodes in states():
        v = view(prefills, decodes)
        plain = decide(prompt, v, 0.0, PROFILE, CFG)
        zeros = {n.node_id: 0 for n in (*prefills, *decodes)}
        assert decide(prompt, v, 0.0, PROFILE, CFG, zeros) == plain
        assert decide(prompt, v, 0.0, PROFILE, CFG, {}) == plain


def test_the_prefill_node_holding_the_prefix_wins_at_equal_load() -> None:
    v = view((prefill_node("p0", chunk=2048), prefill_node("p1", chunk=2048)), (decode_node("d0", b=200, k=900_000),))
    d = decide(8000, v, 0.0, PROFILE, CFG, {"p1": 6000})
    assert d.route is Route.KEEP and d.prefill_node == "p1" and d.cached_tokens == 6000
    # Eq. 1 on p1 starts from its prefix (the keep estimate adds the KV hand-off after it).
    assert d.predicted_prefill_end_s == pytest.approx(prefill_exec_s(PROFILE, 8000, 2048, 6000))
    assert decide(8000, v, 0.0, PROFILE, CFG).prefill_node == "p0"


def test_the_keep_path_goes_where_the_conversation_lives() -> None:
    decodes = (decode_node("d0", b=10, k=50_000), decode_node("d1", b=12, k=60_000))
    v = view((prefill_node("p0", queue=(500_000,), chunk=2048),), decodes)
    assert alg.pick_keep_decode_node(PROFILE, v, 0.0, CFG, 9000).node_id == "d0"
    assert alg.pick_keep_decode_node(PROFILE, v, 0.0, CFG, 9000, {"d1": 8000}).node_id == "d1"


def test_the_keep_transfer_counts_only_the_blocks_the_decode_node_lacks() -> None:
    node = decode_node("d1", b=200, k=900_000)  # too busy to take a deflection
    t = PROFILE.transfer
    whole = alg.keep_handoff_s(PROFILE, CFG, node, 9000, 0.5)
    lacking = alg.keep_handoff_s(PROFILE, CFG, node, 9000, 0.5, cached_tokens=8000)
    assert whole - lacking == pytest.approx(8000 * t.bytes_per_token / t.bandwidth_bytes_per_s)
    assert alg.keep_ttft_s(PROFILE, CFG, 0.5, node, 9000, 8000) == pytest.approx(0.5 + lacking)
    # Algorithm 1's keep estimate is the chosen decode node's: with its hit, the transfer shrinks.
    v = view((prefill_node("p0", chunk=2048),), (decode_node("d0", b=200, k=900_000), node))
    d = decide(9000, v, 0.0, PROFILE, CFG, {"d1": 8000})
    assert d.route is Route.KEEP and d.decode_node == "d1"
    prefill_s = d.predicted_prefill_end_s
    assert prefill_s is not None
    handoff = alg.keep_handoff_s(PROFILE, CFG, node, 9000, prefill_s, 8000)
    assert d.predicted_ttft_prefill_s == pytest.approx(prefill_s + handoff)
    keep = create_policy("pd", PROFILE).decide(9000, v, 0.0, cached={"d1": 8000})  # type: ignore[call-arg]
    assert keep.decode_node == "d1" and keep.predicted_ttft_prefill_s == pytest.approx(d.predicted_ttft_prefill_s)


def test_a_later_turn_deflects_to_the_decode_node_that_holds_it() -> None:
    # The prefill pool has a queue; a 12K-token prompt would need its whole prefill on a decode
    # node (over alpha x the prefill path), but d1 has 11K of it cached.
    prefills = (prefill_node("p0", queue=(30000,), chunk=2048), prefill_node("p1", queue=(30000,), chunk=2048))
    decodes = (decode_node("d0", b=20, k=100_000), decode_node("d1", b=20, k=100_000))
    v = view(prefills, decodes)
    blind = decide(12000, v, 0.0, PROFILE, CFG)
    assert blind.route is Route.KEEP
    d = decide(12000, v, 0.0, PROFILE, CFG, {"d1": 11000})
    assert d.route is Route.DEFLECT and d.reason is Reason.DEFLECT_WITHIN_MARGIN and d.decode_node == "d1"
    assert d.cached_tokens == 11000 and sum(d.chunk_sizes) == 1000
    assert d.schedule[0].cached_tokens == 11000
    assert d.predicted_ttft_decode_s is not None and d.predicted_ttft_prefill_s is not None
    assert d.predicted_ttft_decode_s <= CFG.alpha * d.predicted_ttft_prefill_s


def test_a_hit_is_at_most_all_but_the_last_token() -> None:
    assert alg.cached_prefix({"d0": 5000}, "d0", 5000) == 4999
    assert alg.cached_prefix({"d0": 5000}, "d1", 5000) == 0
    assert alg.cached_prefix(None, "d0", 5000) == 0


def test_the_bounded_search_finds_the_id_order_searchs_node_with_hits() -> None:
    decodes = [
        decode_node(f"d{i}", b=b, k=k)
        for i, (b, k) in enumerate([(60, 200_000), (30, 90_000), (5, 4000), (120, 600_000), (0, 0)])
    ]
    for prompt, hits in itertools.product(
        [900, 5000, 14000], [{}, {"d3": 4000}, {"d0": 800, "d2": 13000}, {"d1": 4500, "d4": 16}]
    ):
        for bound in (0.05, 0.3, 2.0, math.inf):
            a = search_in_id_order(PROFILE, CFG, decodes, prompt, bound, hits)
            facts = [node_facts(PROFILE, CFG, n) for n in decodes]
            b = search_bounded(PROFILE, CFG, decodes, prompt, bound, facts, hits)
            if a[0] is None:  # the flag matters (it picks the keep reason) only when no node fits
                assert b[0] is None and a[1] == b[1]
            else:
                assert b[0] is not None and a[0] == b[0]


@pytest.mark.parametrize("name", ["kairos", "pd"])
def test_prefix_off_policies_ignore_the_hits(name: str) -> None:
    prefills = (prefill_node("p0", queue=(30000,), chunk=2048), prefill_node("p1", queue=(30000,), chunk=2048))
    decodes = (decode_node("d0", b=20, k=100_000), decode_node("d1", b=20, k=100_000))
    v = view(prefills, decodes)
    hits = {"p1": 9000, "d1": 11000}
    aware, blind = create_policy(name, PROFILE), create_policy(f"{name}:prefix=off", PROFILE)
    assert aware.prefix_aware and not blind.prefix_aware  # type: ignore[attr-defined]
    assert blind.label.endswith("prefix=off)")
    assert blind.decide(12000, v, 0.0, cached=hits) == blind.decide(12000, v, 0.0)  # type: ignore[call-arg]
    assert aware.decide(12000, v, 0.0, cached=hits) != aware.decide(12000, v, 0.0)  # type: ignore[call-arg]


def test_the_view_queues_only_the_uncached_work_of_a_dispatch() -> None:
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p0", chunk=2048))
    tracker.update_decode(decode_node("d0", b=20, k=100_000))
    tracker.update_decode(decode_node("d1", b=20, k=100_000))
    v = tracker.view()
    keep = decide(8000, v, 0.0, PROFILE, CFG, {"p0": 6000})
    assert keep.route is Route.KEEP and keep.cached_tokens == 6000
    tracker.record(keep, 0.01)
    view = tracker.view()
    assert queue_load(view.prefill[0]) == queue_load((2000,))  # what p0's queue will report
    assert {n.node_id: n.incoming_keep_tokens for n in view.decode}[keep.decode_node] == 8000  # the KV to hold
