"""Conversations in the simulator: closed-loop turns, and what the nodes' prefix caches save."""

from __future__ import annotations

import pytest

from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.requests import RequestSpec, chain_hashes
from kairos.traffic.workloads import CONVERSATIONS, generate_conversations, make_workload

MODELS = load_profile()
BS = 16


def simulate(requests: list[RequestSpec], spec: str, **cluster: object) -> Simulator:
    sim = Simulator(requests, create_policy(spec, MODELS), MODELS, ClusterConfig(**cluster))  # type: ignore[arg-type]
    sim.run()
    return sim


def two_turns(think_s: float = 5.0) -> list[RequestSpec]:
    """Turn 1: 1000 prompt + 100 answer; turn 2 resends both and 300 new tokens."""
    chain = chain_hashes(range((1400 + 20) // BS))
    return [
        RequestSpec("s-t1", 0.0, 1000, 100, chain[: 1100 // BS], "s", 1),
        # arrival_s is only an estimate: the simulator releases the turn when turn 1 ends.
        RequestSpec("s-t2", 1.0, 1400, 20, chain[: 1420 // BS], "s", 2, after="s-t1", think_s=think_s),
    ]


def test_a_later_turn_arrives_think_time_after_the_previous_turn_ends() -> None:
    sim = simulate(two_turns(think_s=5.0), "pd", prefill_nodes=1, decode_nodes=1)
    first, second = sorted(sim.metrics.records, key=lambda r: r.spec.turn)
    assert first.finished is not None
    assert second.spec.arrival_s == first.finished + 5.0
    assert second.ttft > 0 and second.ttft < 1.0  # measured from its real arrival, not the estimate


def test_a_cache_blind_policy_still_gains_from_the_nodes_caches() -> None:
    sim = simulate(two_turns(), "pd", prefill_nodes=1, decode_nodes=1)
    first, second = sorted(sim.metrics.records, key=lambda r: r.spec.turn)
    assert first.cached_tokens == 0 and first.transfer_tokens == 1000
    # The prefill node holds turn 1's prompt (62 full blocks); the decode node holds its prompt and
    # answer, as far as the answer's last full block before its last token (1099 // 16 = 68 blocks).
    assert second.cached_tokens == 1000 // BS * BS
    assert second.transfer_tokens == 1400 - 68 * BS
    assert second.ttft_parts()[2] == pytest.approx(MODELS.kv_transfer_s(1400 - 68 * BS))
    s = sim.metrics.summary
    assert s["prefix_hit_rate_prefill"] == pytest.approx(992 / 2400)
    assert s["prefix_hit_rate_decode"] == pytest.approx(68 * BS / 2400)
    assert s["p95_ttft_turn2plus_s"] == pytest.approx(second.ttft)


def test_requests_without_hashes_run_as_before() -> None:
    reqs = make_workload("bursty", rps=4, duration_s=30, seed=2)
    sim = simulate(reqs, "pd")
    assert all(r.cached_tokens == 0 and r.transfer_tokens == r.spec.prompt_tokens for r in sim.metrics.records)


# -- the workload ----------------------------------------------------------------------------------
def test_conversations_are_seeded_and_each_turn_extends_the_last() -> None:
    reqs = make_workload("multiturn", rps=3, duration_s=300, seed=4)
    assert reqs == make_workload("multiturn", rps=3, duration_s=300, seed=4)
    assert reqs != make_workload("multiturn", rps=3, duration_s=300, seed=5)
    by_id = {r.request_id: r for r in reqs}
    later = [r for r in reqs if r.turn >= 2]
    assert later and all(r.after is not None for r in later)
    for r in later:
        prev = by_id[r.after]  # type: ignore[index]
        assert r.session_id == prev.session_id and r.turn == prev.turn + 1
        assert r.prompt_tokens > prev.prompt_tokens + prev.output_tokens  # + a new message
        assert r.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
        assert len(r.block_hashes) == (r.prompt_tokens + r.output_tokens) // BS
        assert r.arrival_s > prev.arrival_s + r.think_s
    assert all(r.after is None and r.think_s == 0 for r in reqs if r.turn == 1)
    # Turns per second near the asked rate (sessions at rps / mean turns): a fixed seed, a fixed count.
    assert 0.85 * 3 * 300 < len(reqs) < 1.15 * 3 * 300


def test_sessions_share_a_system_prompt_and_nothing_else() -> None:
    spec = CONVERSATIONS["multiturn"]
    reqs = [r for r in generate_conversations(spec, rps=2, num_requests=400, seed=1) if r.turn == 1]
    firsts = {r.block_hashes[0] for r in reqs}
    # Three system prompts, and sessions without one start with a block of their own.
    groups = [[r for r in reqs if r.block_hashes[0] == h] for h in firsts]
    shared = [g for g in groups if len(g) > 1]
    depths = set()
    for group in shared:
        common = min(len(r.block_hashes) for r in group)
        depths.add(next((i for i in range(common) if len({r.block_hashes[i] for r in group}) > 1), common))
    assert depths == {n // BS for n in spec.system_prompts}


def test_num_requests_keeps_whole_session_prefixes() -> None:
    reqs = make_workload("multiturn", num_requests=50, seed=2)
    ids = {r.request_id for r in reqs}
    assert len(reqs) == 50 and all(r.after is None or r.after in ids for r in reqs)


def test_prefix_aware_kairos_prefills_later_turns_where_they_live_within_tbt() -> None:
    """With the deflection gate off, which keeps most of this light load's requests (their keep
    paths meet the SLO with room) and would leave too few deflections to compare."""
    reqs = make_workload("multiturn", rps=12, duration_s=60, seed=3)
    sim = simulate(reqs, "kairos:gate=off")
    s = sim.metrics.summary
    assert s["tbt_violation_rate"] == 0.0 and s["requests"] == len(reqs)
    deflected = [r for r in sim.metrics.records if r.route.value == "deflect" and r.spec.turn >= 2]
    assert deflected and sum(r.cached_tokens > 0 for r in deflected) >= 0.9 * len(deflected)
    assert all(r.cached_tokens <= r.spec.prompt_tokens - 1 for r in sim.metrics.records)
    blind = simulate(reqs, "kairos:gate=off,prefix=off").metrics.records
    assert sum(r.route.value == "deflect" for r in blind) < len(deflected)
