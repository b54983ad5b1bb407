"""The dispatcher's prefix index, built from the nodes' KV-cache events: what it matches, how it
resynchronises, when it is stale, and that the engine's events rebuild its cache exactly."""

from __future__ import annotations

import random

import pytest

from kairos.common.contracts import Role
from kairos.core.latency import load_profile
from kairos.core.policies import make_policy
from kairos.sim.engine import Engine, EngineConfig, Sequence, StepPlan
from kairos.sim.kv_event_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    NodePrefixIndex,
    PrefixIndex,
)
from kairos.sim.prefix_cache import chain_hashes
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.sim.workloads import make_workload

BS = 16
H = chain_hashes(range(10))


def batch(seq: int, *events: object, at: float = 0.0) -> KvEventBatch:
    return KvEventBatch(seq, at, tuple(events))  # type: ignore[arg-type]


def test_stored_and_removed_blocks_set_the_longest_prefix() -> None:
    node = NodePrefixIndex()
    node.apply(batch(0, BlockStored(H[:6])))
    assert node.longest_prefix(H, 10) == 6 and node.longest_prefix(H, 4) == 4
    node.apply(batch(1, BlockRemoved(H[3:4])))
    assert node.longest_prefix(H, 10) == 3
    node.apply(batch(2, AllBlocksCleared()))
    assert node.longest_prefix(H, 10) == 0 and len(node) == 0


def test_a_gap_or_a_restart_empties_the_index_and_a_replayed_batch_is_ignored() -> None:
    node = NodePrefixIndex()
    node.apply(batch(0, BlockStored(H[:4])))
    node.apply(batch(1, BlockStored(H[4:6])))
    node.apply(batch(1, BlockRemoved(H[:6])))  # already applied: ignored
    assert node.longest_prefix(H, 10) == 6 and node.resets == 0
    node.apply(batch(3, BlockStored(H[6:7])))  # batch 2 missed: what it said is unknown
    assert node.resets == 1 and len(node) == 1 and node.longest_prefix(H, 10) == 0
    node.apply(batch(0, BlockStored(H[:2])))  # the node restarted: numbering from 0 again
    assert node.resets == 2 and node.longest_prefix(H, 10) == 2


def test_memory_is_bounded_oldest_stored_first() -> None:
    node = NodePrefixIndex(max_blocks=4)
    node.apply(batch(0, BlockStored(H[:3])))
    node.apply(batch(1, BlockStored(H[3:6])))
    assert len(node) == 4 and node.longest_prefix(H, 10) == 0  # H[0], H[1] dropped: never a false hit
    assert node.longest_prefix(H[2:], 10) == 4


def test_hits_are_tokens_capped_below_the_prompt_and_zero_on_a_stale_index() -> None:
    index = PrefixIndex(BS)
    index.apply("d0", [batch(0, BlockStored(H[:8]), at=1.0)])
    index.apply("d1", [batch(0, BlockStored(H[:2]), at=1.0)])
    assert index.cached_tokens(H, 8 * BS, 1.2, 0.35) == {"d0": 7 * BS, "d1": 2 * BS}
    assert index.cached_tokens(H, 200, 2.0, 0.35) == {}  # nothing heard for 1 s: stale
    index.confirm("d0", 0, 1.9)  # a heartbeat: batch 0 is still d0's last, so the index is complete
    index.confirm("d1", 3, 1.9)  # d1 sent batches 1-3 the index has not seen
    assert index.cached_tokens(H, 200, 2.0, 0.35) == {"d0": 8 * BS}
    assert index.cached_tokens((), 200, 2.0, 0.35) == {}
    index.forget("d0")
    assert index.cached_tokens(H, 200, 2.0, 0.35) == {}


def fixed_timer(role: Role, plan: StepPlan) -> float:
    return 0.05


def test_the_engines_events_rebuild_its_cache_exactly() -> None:
    rng = random.Random(7)
    engine = Engine(EngineConfig("n0", Role.DECODE, 4096, 40 * BS), fixed_timer)
    engine.record_kv_events()
    index = PrefixIndex(BS)
    conversations = [chain_hashes((c, b) for b in range(30)) for c in range(5)]
    t = 0.0
    for i in range(60):
        hashes = rng.choice(conversations)
        prompt = rng.randint(20, 300)
        engine.submit(Sequence(f"r{i}", prompt, rng.randint(1, 60), block_hashes=hashes))
        for _ in range(rng.randint(1, 8)):
            plan = engine.plan_step(t)
            if plan is None:
                break
            t += 0.05
            engine.finish_step(plan, t, 0.05)
        published = engine.publish_kv_events(t)
        index.apply("n0", [published] if published else [])
        for h in conversations:
            assert index.nodes["n0"].longest_prefix(h, 30) == (engine.cache.match(h) if engine.cache else 0)
    assert engine.kv_seq is not None and index.nodes["n0"].resets == 0


@pytest.mark.parametrize("spec", ["kairos", "pd"])
def test_the_simulator_decides_on_the_index_of_the_events(spec: str) -> None:
    models = load_profile()
    reqs = make_workload("multiturn", rps=12, duration_s=60, seed=3)
    runs = {}
    for index in (False, True):
        sim = Simulator(reqs, make_policy(spec, models), models, ClusterConfig(prefix_index=index))
        runs[index] = sim.run().summary
        if index:
            assert sim.prefix_index is not None and set(sim.prefix_index.nodes) == set(sim.engines)
    # The index lags the caches by up to a heartbeat; what it sees differs little from the truth.
    assert runs[True]["tbt_violation_rate"] == 0.0
    assert runs[True]["prefix_hit_rate_decode"] > 0.5 and runs[False]["prefix_hit_rate_decode"] > 0.5
    assert abs(runs[True]["prefix_hit_rate_decode"] - runs[False]["prefix_hit_rate_decode"]) < 0.05
