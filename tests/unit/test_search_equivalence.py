"""The bounded deflection search decides exactly what the plain one did: ``decide`` against the
search it replaced (every eligible decode node in id order, kept below as the reference) over
random views, profiles and configs, the same ``Decision`` in every field. And the bound the
search skips nodes by never exceeds the TTFT of the schedule it stands for.

Hypothesis runs derandomized (the same examples every run); the views draw their decode nodes
from a few (B, K) shapes so that ties between nodes, which the node id breaks, are common."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.algorithm import search as deflection_search
from kairos.core.algorithm.bounds import node_facts, plan_on_path
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from tests.builders import flat_models, make_models
from tests.unit import test_algorithm


@pytest.fixture(autouse=True)
def bounded_from_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounded search on every view here, however few its nodes."""
    monkeypatch.setattr(deflection_search, "BOUNDED_SEARCH_MIN_NODES", 1)


MODELS: dict[str, LatencyModels] = {
    "packaged": load_profile(),
    "round": make_models(),
    "flat": flat_models(),  # no cached-token cost: a safe chunk stays safe for ever
    "knee": make_models(mixed_knee=600.0, mixed_over_knee=5e-5, decode_per_k=2e-8, mixed_p_x_k=1e-10),
    "negative": make_models(mixed_p_x_b=-1e-6),  # not bounded: the search runs in id order
}
NOW = 0.05
EXAMPLES = settings(
    max_examples=400, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- the reference: Algorithm 1 as it was before the bounded search ----------------------------
def reference_best_prefill(
    models: LatencyModels, view: ClusterView, config: alg.DeciderConfig, prompt: int
) -> tuple[PrefillNodeState, float]:
    fresh = [n for n in view.prefill if alg.is_fresh(n.reported_at, NOW, config)] or list(view.prefill)
    ttft, _, node = min(
        ((alg.keep_prefill_s(models, config, n, prompt, 0, NOW), n.node_id, n) for n in fresh),
        key=lambda x: (x[0], x[1]),
    )
    return node, ttft


def reference_keep_decode(
    models: LatencyModels, view: ClusterView, config: alg.DeciderConfig, prompt: int
) -> DecodeNodeState:
    fresh = [n for n in view.decode if alg.is_fresh(n.reported_at, NOW, config)] or list(view.decode)
    roomy = [n for n in fresh if n.free_kv_tokens >= prompt] or fresh
    return min(roomy, key=lambda n: (alg.decode_load_s(models, n), n.node_id))


def reference_decide(prompt: int, view: ClusterView, models: LatencyModels, config: alg.DeciderConfig) -> Decision:
    prefill_node, prefill_s = reference_best_prefill(models, view, config, prompt)
    keep_decode = reference_keep_decode(models, view, config, prompt)
    # Eq. 7 compares with the keep path's estimate on the keep pick (test_algorithm checks its terms)
    ttft_pf = alg.keep_ttft_s(models, config, prefill_s, keep_decode, prompt, 0, NOW)

    def keep(reason: Reason, ttft_dec: float | None) -> Decision:
        return Decision(
            Route.KEEP,
            reason,
            keep_decode.node_id,
            prefill_node.node_id,
            (),
            ttft_pf,
            ttft_dec,
            prompt,
            predicted_prefill_end_s=prefill_s,
            step_budget_s=config.step_budget_s / keep_decode.step_calibration if config.node_step_guard else None,
        )

    eligible = [n for n in view.decode if alg.can_take_deflection(n, NOW, config, prompt)]
    if not eligible:
        return keep(Reason.KEEP_NO_ELIGIBLE_DECODE, None)
    if config.decode_overload_guard:
        line = {n.node_id: config.decode_overload_s / n.step_calibration for n in eligible}
        share = config.decode_pressure_share
        pressure = share is not None and ttft_pf <= config.ttft_slo_s  # the keep path meets the SLO
        eligible = [
            n
            for n in eligible
            if alg.decode_load_s(models, n) <= line[n.node_id]
            and not (pressure and alg.decode_load_after_s(models, n, prompt) > share * config.decode_overload_s)
        ]
        if not eligible:
            return keep(Reason.KEEP_DECODE_OVERLOADED, None)
    gate = config.deflect_gate_share  # the deflection gate: the keep path meets the SLO with room
    if gate is not None and ttft_pf < gate * config.ttft_slo_s:
        return keep(Reason.KEEP_SLO_ROOM, None)
    margin_s = config.alpha * ttft_pf
    bound = min(margin_s, config.ttft_slo_s)
    best = None
    any_too_slow = False
    memo: dict[tuple[object, ...], object] = {}
    for node in sorted(eligible, key=lambda n: n.node_id):
        key = (node.decode_tokens, node.kv_tokens, node.prefill_backlog_tokens, node.step_calibration)
        key += (node.running_step_elapsed_s, node.reported_at, node.overlay_backlog)  # where the node's step is
        if config.plan_with_pulls:  # plan_on_decode_node plans beside the pulls: they are part of the node's plan
            key += (node.pending_kv_pull_tokens,)
        give_up = bound if best is None else min(bound, best[0])
        plan = memo.get(key)
        if plan is None:
            plan = memo[key] = alg.plan_on_decode_node(models, config, node, prompt, give_up, 0, NOW)
        if plan == "too_slow":
            any_too_slow = True
        elif not isinstance(plan, str) and (best is None or plan.ttft_s < best[0]):
            best = (plan.ttft_s, node.node_id, plan, node)
    if best is None:
        if not any_too_slow:
            return keep(Reason.KEEP_NO_SAFE_SCHEDULE, None)
        return keep(Reason.KEEP_DECODE_SLOWER if margin_s <= config.ttft_slo_s else Reason.KEEP_DECODE_OVER_SLO, None)
    ttft_dec, node_id, plan, chosen = best
    if ttft_dec > margin_s:
        return keep(Reason.KEEP_DECODE_SLOWER, ttft_dec)
    if ttft_dec > config.ttft_slo_s:
        return keep(Reason.KEEP_DECODE_OVER_SLO, ttft_dec)
    sizes, times = alg.expand_runs(plan.runs)
    return Decision(
        Route.DEFLECT,
        Reason.DEFLECT_WITHIN_MARGIN,
        node_id,
        None,
        tuple(sizes),
        ttft_pf,
        ttft_dec,
        prompt,
        config.step_budget_s / chosen.step_calibration if config.node_step_guard else None,
        tuple(times),
        plan.decode_tokens,
    )


# -- random scenes -------------------------------------------------------------------------------
configs = st.builds(
    alg.DeciderConfig,
    split=st.just("off"),  # the deflection search's equivalence; the split's own: test_split.py
    alpha=st.sampled_from([1.0, 1.3, 3.0]),
    beta=st.sampled_from([0.8, 1.0]),
    tbt_slo_s=st.sampled_from([0.05, 0.07, 0.1, 0.2]),
    ttft_slo_s=st.sampled_from([0.5, 4.0, 30.0]),
    chunk_candidates=st.sampled_from([alg.DEFAULT_CHUNK_CANDIDATES, (1024, 256, 64), (600,)]),
    max_pending_deflections=st.sampled_from([1, 2, None]),
    decode_overload_guard=st.booleans(),
    model_error=st.sampled_from([0.0, 0.0, 0.1]),
    keep_estimate=st.sampled_from(alg.KEEP_ESTIMATES),
    deflect_gate_share=st.sampled_from([None, None, 0.25, 1.0]),
    # 0.3: a low line, so the rule refuses nodes the search would reach, or all of them
    decode_pressure_share=st.sampled_from([None, defaults.DECODE_PRESSURE_SHARE, 0.3]),
    plan_with_pulls=st.booleans(),
)
shapes = st.tuples(st.integers(0, 80), st.integers(0, 400_000))  # (B, K)


@st.composite
def decode_nodes(draw: st.DrawFn, n: int) -> tuple[DecodeNodeState, ...]:
    pool = draw(st.lists(shapes, min_size=1, max_size=5))
    ids = draw(st.permutations(range(n)))  # the view's order is not the ids' order
    nodes = []
    for i in ids:
        b, k = draw(st.sampled_from(pool) | shapes)
        backlog = tuple(draw(st.lists(st.integers(1, 6000), max_size=2)))
        nodes.append(
            DecodeNodeState(
                f"d{i}",
                b,
                k,
                kv_capacity_tokens=draw(st.sampled_from([10_000_000, k + 20_000, k])),
                reported_at=draw(st.sampled_from([0.0, 0.0, 0.0, -1.0])),  # -1.0: stale
                prefill_backlog_tokens=backlog,
                incoming_keeps=draw(st.integers(0, 2)),
                incoming_keep_tokens=draw(st.integers(0, 8000)),
                step_calibration=draw(st.sampled_from([1.0, 1.0, 1.0, 0.8, 1.3])),
                pending_kv_pull_tokens=tuple(draw(st.lists(st.integers(1, 30_000), max_size=3))),
                # How long its step in flight had run (None: a node older than the field), and
                # how many of its backlog were sent since its heartbeat.
                running_step_elapsed_s=draw(st.sampled_from([None, 0.0]) | st.floats(0.0, 0.3)),
                overlay_backlog=draw(st.integers(0, len(backlog))),
            )
        )
    return tuple(nodes)


@st.composite
def views(draw: st.DrawFn) -> ClusterView:
    prefill = tuple(
        PrefillNodeState.from_queue(
            f"p{i}",
            draw(st.lists(st.integers(1, 8000), max_size=30)),
            draw(st.sampled_from([256, 512, 2048])),
            reported_at=draw(st.sampled_from([0.0, -1.0])),
        )
        for i in range(draw(st.integers(1, 4)))
    )
    return ClusterView(prefill=prefill, decode=draw(decode_nodes(draw(st.integers(1, 40)))))


prompts = st.integers(1, 40_000) | st.sampled_from([1, 128, 1024, 2047, 2048, 2049, 10_240, 32_768])


@EXAMPLES
@given(
    view=views(),
    prompt=prompts,
    config=configs,
    first=st.sampled_from(sorted(MODELS)),
    second=st.sampled_from(sorted(MODELS)),
)
def test_decide_equals_the_plain_search(
    view: ClusterView, prompt: int, config: alg.DeciderConfig, first: str, second: str
) -> None:
    # Twice on the same state objects, under two profiles: what one decision derived and kept on
    # a node's state must not leak into a decision under other models.
    for models in (MODELS[first], MODELS[second]):
        assert alg.decide(prompt, view, NOW, models, config) == reference_decide(prompt, view, models, config)


@EXAMPLES
@given(view=views(), prompt=prompts, config=configs, seed=st.integers(0, 2**32))
def test_any_valid_bound_gives_the_same_decision(
    view: ClusterView, prompt: int, config: alg.DeciderConfig, seed: int
) -> None:
    """The search's result must not depend on how tight the bound is, only on its being a lower
    bound: here it is the real one scaled down at random (so nodes are visited in an arbitrary
    order, a higher id before a tie's lower one), and any number at all where no schedule exists."""
    rng = random.Random(seed)
    real = deflection_search.lower_bound_from_facts  # what the search calls: ttft_lower_bound_s from the node's facts

    def loose(facts: Any, node: DecodeNodeState, prompt: int, now: float | None = None) -> float:
        bound = real(facts, node, prompt, now)
        if math.isinf(bound):
            return rng.choice([math.inf, rng.uniform(0.0, 10.0)])
        return bound * rng.choice([0.0, 1.0, rng.random()])

    models = MODELS["packaged" if seed % 2 else "round"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deflection_search, "lower_bound_from_facts", loose)
        got = alg.decide(prompt, view, NOW, models, config)
    assert got == reference_decide(prompt, view, models, config)


@EXAMPLES
@given(
    node=decode_nodes(1).map(lambda nodes: nodes[0]),
    prompt=prompts,
    config=configs,
    name=st.sampled_from(sorted(n for n, m in MODELS.items() if m.mixed_nonnegative)),
)
def test_lower_bound_never_exceeds_the_schedules_ttft(
    node: DecodeNodeState, prompt: int, config: alg.DeciderConfig, name: str
) -> None:
    models = MODELS[name]
    for now in (None, NOW):  # from the heartbeat, and shifted to now by the node's step phase
        plan = alg.plan_on_decode_node(models, config, node, prompt, math.inf, 0, now)
        bound = alg.ttft_lower_bound_s(models, config, node, prompt, now)
        if isinstance(plan, str):
            assert plan == "infeasible"
        else:
            assert 0 < bound <= plan.ttft_s * (1 + 1e-12), (bound, plan.ttft_s)


@EXAMPLES
@given(
    node=decode_nodes(1).map(lambda nodes: replace(nodes[0], prefill_backlog_tokens=(), overlay_backlog=0)),
    prompt=prompts,
    config=configs,
    name=st.sampled_from(sorted(n for n, m in MODELS.items() if m.mixed_nonnegative)),
    give_up=st.sampled_from([math.inf, 0.0]) | st.floats(0.0, 30.0),
)
def test_a_schedule_read_off_the_nodes_path_is_the_greedys_to_the_bit(
    node: DecodeNodeState, prompt: int, config: alg.DeciderConfig, name: str, give_up: float
) -> None:
    models = MODELS[name]
    for now in (None, NOW):
        expected = alg.plan_on_decode_node(models, config, node, prompt, give_up, 0, now)
        assert plan_on_path(models, config, node, prompt, give_up, 0, now) == expected


@pytest.mark.parametrize("name", sorted(n for n, m in MODELS.items() if m.mixed_nonnegative))
def test_schedules_read_off_paths_over_a_sweep(name: str) -> None:
    """Many schedules that leave the path after its first run, where the time at the tail's
    start is a sum over several runs (hypothesis draws few of them)."""
    rng, models = random.Random(name), MODELS[name]
    for _ in range(1500):
        config = alg.DeciderConfig(tbt_slo_s=rng.choice([0.05, 0.07, 0.1, 0.2]))
        node = DecodeNodeState("d0", rng.randint(0, 80), rng.randint(0, 400_000), 10_000_000, 0.0)
        prompt, give_up = rng.randint(1, 40_000), rng.choice([math.inf, rng.uniform(0.0, 30.0)])
        expected = alg.plan_on_decode_node(models, config, node, prompt, give_up)
        assert plan_on_path(models, config, node, prompt, give_up) == expected, (node, prompt, give_up)


@pytest.mark.parametrize("case", test_algorithm.DECIDE_CASES)
def test_the_decision_table_holds_under_the_bounded_search(case: test_algorithm.DecideCase) -> None:
    test_algorithm.test_decide(case)  # its nodes are few: the search would otherwise go in id order


@pytest.mark.parametrize("seed", range(12))
def test_large_clusters_decide_as_the_plain_search(seed: int) -> None:
    """Hundreds of decode nodes, many within a few tokens of KV of each other (the bound cannot
    tell them apart, so the search must), on the packaged profile and its defaults."""
    rng = random.Random(seed)
    models, config = MODELS["packaged"], alg.DeciderConfig()
    decode = tuple(
        DecodeNodeState(f"d{i}", b, b * 3569 + rng.choice([0, 0, 1, 97 * i]), 1_300_000, reported_at=0.0)
        for i in rng.sample(range(512), rng.choice([64, 128, 512]))
        for b in [4 + rng.randrange(64)]
    )
    prefill = tuple(PrefillNodeState.from_queue(f"p{i}", (3569,) * rng.randrange(0, 40), 2048, 0.0) for i in range(2))
    view = ClusterView(prefill=prefill, decode=decode)
    for prompt in (1024, 4096, 10_240, 20_000, 32_768):
        assert alg.decide(prompt, view, NOW, models, config) == reference_decide(prompt, view, models, config)


def test_what_a_decision_keeps_on_a_state_is_not_part_of_it() -> None:
    node = DecodeNodeState("d0", 4, 14_000, 1_300_000, 0.0)
    view = ClusterView(prefill=(PrefillNodeState.from_queue("p0", (3569,) * 12, 2048, 0.0),), decode=(node,))
    alg.decide(10_240, view, NOW, MODELS["packaged"], alg.DeciderConfig())
    assert node.derived is not None
    renewed = replace(node)
    assert renewed == node and renewed.derived is None and repr(renewed) == repr(node)


@pytest.mark.parametrize("search", ["bounded", "in_id_order"])
def test_a_node_the_pressure_rule_refuses_is_never_planned_nor_counted_too_slow(search: str) -> None:
    """Refused nodes are as if absent: none is the winner, and none that would run past the
    bound makes the reason 'slower' rather than 'no safe schedule'."""
    models, config, prompt = MODELS["packaged"], alg.DeciderConfig(), 10_240
    nodes = [DecodeNodeState(f"d{i}", 4 + i, 14_000 * (i + 1), 1_300_000, 0.0) for i in range(3)]
    facts = [node_facts(models, config, n) for n in nodes]

    def run(bound: float, refused: Any) -> tuple[Any, bool]:
        if search == "bounded":
            return deflection_search.search_bounded(models, config, nodes, prompt, bound, facts, None, refused)
        return deflection_search.search_in_id_order(models, config, nodes, prompt, bound, None, refused)

    (_, winner, _), _ = run(math.inf, None)
    (_, second, _), _ = run(math.inf, lambda n: n.node_id == winner)
    assert second != winner
    assert run(math.inf, lambda n: True) == (None, False)
    assert run(1e-6, None) == (None, True)  # every schedule runs past so tight a bound
    assert run(1e-6, lambda n: True) == (None, False)
