"""The split route's decision (kairos.core.algorithm.split): its k grid, the k each rule picks, the
decision it makes, and the view's account of it until a heartbeat shows it."""

from __future__ import annotations

import dataclasses

import pytest

from kairos.common.errors import ConfigError
from kairos.core import algorithm as alg
from kairos.core.algorithm import split as split_mod
from kairos.core.algorithm.config import node_step_budget_s
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.state import ClusterView
from kairos.core.view import ClusterTracker
from tests.builders import decode_node, flat_models, prefill_node, view

# A 100 MB/s link, a prefill node with a queue and one decode node of 20 decodes: the keep path
# and the deflection take about as long (test_algorithm's Eq. 7 table), so a split can beat both.
FAST_LINK = flat_models(bandwidth_bytes_per_s=1e8)
CFG = alg.DeciderConfig(
    deflect_gate_share=None,
    alpha=1.3,
    beta=1.0,
    tbt_slo_s=0.105,
    ttft_slo_s=4.0,
    chunk_candidates=(420, 220, 120),
    stale_after_s=0.35,
    max_pending_deflections=1,
    kv_block_tokens=16,
    split="offload",
)


def cluster(queue: int = 429, b: int = 20) -> ClusterView:
    return view((prefill_node(queue=(queue,)),), (decode_node("d1", b=b),))


@pytest.mark.parametrize(
    ("prompt", "floor", "grid", "block", "points"),
    [
        (1000, 0, 8, 16, [112, 240, 368, 496, 624, 736, 864]),  # 125 x j, down to a block
        (1000, 500, 4, 16, [624, 736, 864]),  # above the decode node's own prefix
        (40, 0, 8, 16, [16, 32]),  # equal cuts that round to one block count once
        (16, 0, 8, 16, []),  # no block boundary strictly inside the prompt
        (1000, 990, 8, 16, [992]),
        (1000, 999, 8, 16, []),
    ],
)
def test_split_points_are_block_aligned_cuts_strictly_inside_the_uncached_prompt(
    prompt: int, floor: int, grid: int, block: int, points: list[int]
) -> None:
    assert alg.split_points(prompt, floor, grid, block) == points


def _ttft_at(models: LatencyModels, config: alg.DeciderConfig, v: ClusterView, prompt: int, k: int) -> float | None:
    """The split's TTFT at one k on the view's one decode node, as best_split computes it."""
    p, node = v.prefill[0], v.decode[0]
    end = alg.keep_prefill_s(models, config, p, k, 0, 0.0)
    lands = end + split_mod.kv_landing_s(models, config, node, prompt, k, end, 0, 0.0)
    tail = split_mod._NodeTail(models, config, node, 0.0)
    assert tail.start is not None
    plan = tail.plan(prompt, k, lands, float("inf"))
    return None if isinstance(plan, str) else plan.ttft_s


def test_offload_takes_the_smallest_k_within_eq7s_bound_and_fastest_the_quickest() -> None:
    v, prompt = cluster(), 1000
    d = alg.decide(prompt, v, 0.0, FAST_LINK, CFG)
    assert d.route is Route.SPLIT and d.reason is Reason.SPLIT_WITHIN_MARGIN
    bound = min(CFG.alpha * d.predicted_ttft_prefill_s, CFG.ttft_slo_s)  # type: ignore[operator]
    points = alg.split_points(prompt, 0, CFG.split_points, CFG.kv_block_tokens)
    ttfts = {k: _ttft_at(FAST_LINK, CFG, v, prompt, k) for k in points}
    assert d.split_tokens in points
    assert d.predicted_ttft_decode_s == pytest.approx(ttfts[d.split_tokens], rel=1e-12)
    assert d.predicted_ttft_decode_s <= bound
    # From the prompt's end down, every k to the one taken meets the bound, and the next one does
    # not: as much prefill taken off the prefill node as Eq. 7 allows.
    assert all(t is not None and t <= bound for k, t in ttfts.items() if k >= d.split_tokens)
    below = [t for k, t in ttfts.items() if k < d.split_tokens]
    assert not below or below[-1] is None or below[-1] > bound

    fastest = alg.decide(prompt, v, 0.0, FAST_LINK, dataclasses.replace(CFG, split="fastest"))
    assert fastest.route is Route.SPLIT
    best = min(t for t in ttfts.values() if t is not None)
    assert fastest.predicted_ttft_decode_s == pytest.approx(best, rel=1e-12)
    assert fastest.predicted_ttft_decode_s < fastest.predicted_ttft_prefill_s  # type: ignore[operator]
    assert fastest.split_tokens >= d.split_tokens


def test_a_split_decision_carries_its_prefill_node_k_and_a_tbt_safe_schedule_of_the_rest() -> None:
    d = alg.decide(1000, cluster(), 0.0, FAST_LINK, CFG)
    assert d.prefill_node == "p1" and d.decode_node == "d1"
    assert d.split_tokens % CFG.kv_block_tokens == 0 and 0 < d.split_tokens < 1000
    assert sum(d.chunk_sizes) == 1000 - d.split_tokens
    budget = node_step_budget_s(CFG, cluster().decode[0])
    assert d.step_budget_s == budget and all(t <= budget * (1 + 1e-12) for t in d.predicted_step_s)
    # Each step of the rest attends over the k tokens pulled and the rest's earlier chunks.
    steps = d.schedule
    assert steps[0].cached_tokens == d.split_tokens
    assert [s.prefill_tokens for s in steps] == list(d.chunk_sizes)
    assert d.predicted_prefill_end_s is not None and 0 < d.predicted_prefill_end_s < d.predicted_ttft_decode_s  # type: ignore[operator]


def test_split_off_is_algorithm_1s_two_routes() -> None:
    off = dataclasses.replace(CFG, split="off")
    d = alg.decide(1000, cluster(), 0.0, FAST_LINK, off)
    assert (d.route, d.reason) == (Route.KEEP, Reason.KEEP_DECODE_SLOWER)


def test_no_split_where_the_decode_node_may_take_no_deflection_or_a_deflection_wins() -> None:
    busy = view((prefill_node(queue=(429,)),), (decode_node("d1", b=20, backlog=(500,)),))  # the pending limit
    assert alg.decide(1000, busy, 0.0, FAST_LINK, CFG).route is Route.KEEP
    assert alg.decide(1000, cluster(queue=430), 0.0, FAST_LINK, CFG).route is Route.DEFLECT  # Eq. 7 holds
    gated = dataclasses.replace(CFG, deflect_gate_share=1.0)  # the keep path is well within the SLO
    assert alg.decide(1000, cluster(), 0.0, FAST_LINK, gated).reason is Reason.KEEP_SLO_ROOM


def test_the_decode_nodes_cached_prefix_is_not_pulled_and_bounds_k_below() -> None:
    v, prompt = cluster(queue=100), 1000
    d = alg.decide(prompt, v, 0.0, FAST_LINK, CFG, cached={"d1": 160})
    assert d.route is Route.SPLIT and d.split_tokens > 160
    assert d.split_tokens in alg.split_points(prompt, 160, CFG.split_points, CFG.kv_block_tokens)
    # The prefill node's own prefix of the first k is what it reports as cached (not prefilled).
    on_both = alg.decide(prompt, v, 0.0, FAST_LINK, CFG, cached={"d1": 160, "p1": 64})
    assert on_both.route is Route.SPLIT and on_both.cached_tokens == 64


@pytest.mark.parametrize(
    "kwargs", [{"split": "half"}, {"split_points": 1}, {"kv_block_tokens": 0}], ids=["rule", "grid", "block"]
)
def test_bad_split_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        alg.DeciderConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split_tokens": 0},
        {"split_tokens": 1000},
        {"split_tokens": 600, "chunk_sizes": (300,)},  # the schedule must cover the rest, 400
        {"split_tokens": 600, "prefill_node": None},
    ],
    ids=["no k", "k is the prompt", "short schedule", "no prefill node"],
)
def test_an_inconsistent_split_decision_is_refused(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "route": Route.SPLIT,
        "reason": Reason.SPLIT_WITHIN_MARGIN,
        "decode_node": "d1",
        "prefill_node": "p1",
        "chunk_sizes": (400,),
        "predicted_ttft_prefill_s": 1.0,
        "predicted_ttft_decode_s": 0.9,
        "prompt_tokens": 1000,
        "split_tokens": 600,
    }
    with pytest.raises(ValueError, match="split"):
        Decision(**{**fields, **kwargs})  # type: ignore[arg-type]
    assert Decision(**fields).split_tokens == 600  # type: ignore[arg-type]


def test_the_view_holds_a_split_on_both_nodes_until_a_heartbeat_after_its_landing_and_cancel_takes_it_back() -> None:
    v = cluster()
    tracker = ClusterTracker()
    tracker.update_prefill(v.prefill[0])
    tracker.update_decode(v.decode[0])
    d = alg.decide(1000, v, 0.0, FAST_LINK, CFG)
    handle = tracker.record(d, 0.0)
    seen = tracker.view()
    assert seen.prefill[0].outstanding_tokens == 429 + d.split_tokens  # its first k queue there
    node = seen.decode[0]
    assert node.prefill_backlog_tokens == (1000 - d.split_tokens,)  # the rest, over the k pulled
    assert node.prefill_backlog_computed_tokens == (d.split_tokens,)
    assert node.incoming_keeps == 1 and node.incoming_keep_tokens == d.split_tokens
    # The node is barred to another deflection or split while the rest is on its way.
    assert alg.decide(1000, seen, 0.0, FAST_LINK, CFG).route is Route.KEEP
    # A heartbeat before the predicted landing does not show the rest yet: it stays in the view.
    lands = d.predicted_ttft_decode_s - sum(d.predicted_step_s)  # type: ignore[operator]
    tracker.update_decode(dataclasses.replace(v.decode[0], reported_at=lands / 2))
    assert tracker.view().decode[0].prefill_backlog_tokens == (1000 - d.split_tokens,)
    tracker.cancel(handle)
    after = tracker.view()
    assert after.decode[0].prefill_backlog_tokens == () and after.prefill[0].outstanding_tokens == 429
