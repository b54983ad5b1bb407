"""The engine model's KV-cache events: vLLM's own event types (``kairos.common.kv_events``) in
numbered batches, in the shapes vLLM's block pool gives them, and the gateway's prefix index
(``kairos.core.prefix_index``) rebuilt from them exactly; the simulator's event-fed deciders
read that index."""

from __future__ import annotations

import random

import pytest

from kairos.common.block_hash import block_keys
from kairos.common.contracts import Role
from kairos.common.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    decode_batch,
    encode_batch,
)
from kairos.core.kv_event_sync import EventStreamSync
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.core.prefix_index import PrefixIndex, prompt_prefix_hits
from kairos.sim.engine import Engine, EngineConfig, Sequence, StepPlan
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.requests import chain_hashes
from kairos.traffic.workloads import make_workload

BS = 16


def fixed_timer(role: Role, plan: StepPlan) -> float:
    return 0.05


def drain(engine: Engine, t: float = 0.0, limit: int = 1000) -> float:
    for _ in range(limit):
        plan = engine.plan_step(t)
        if plan is None:
            return t
        t += 0.05
        engine.finish_step(plan, t, 0.05)
    raise AssertionError("engine did not drain")


def recording(kv: int = 100_000, caching: bool = True) -> Engine:
    engine = Engine(EngineConfig("n0", Role.DECODE, 4096, kv, prefix_caching=caching), fixed_timer)
    engine.record_kv_events()
    return engine


def test_a_prompt_is_stored_in_one_event_with_its_parent_and_tokens() -> None:
    engine = recording()
    tokens = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks and 3 tokens
    keys = tuple(block_keys(tokens, BS))
    engine.submit(Sequence("a", len(tokens), 1, block_hashes=keys, token_ids=tokens))
    drain(engine)
    seq, batch = engine.publish_kv_events(1.5) or (None, None)
    assert seq == 0 and batch is not None and batch.ts == 1.5
    assert batch.events == (BlockStored(keys, None, tuple(tokens[: 5 * BS]), BS, None, MEDIUM_GPU, None, None, 0),)
    assert engine.publish_kv_events(2.0) is None  # nothing changed since
    # A longer prompt hits those 5 blocks and stores only the 3 it adds, after their last.
    longer = tokens + list(range(3 * BS))
    keys2 = tuple(block_keys(longer, BS))
    engine.submit(Sequence("b", len(longer), 1, block_hashes=keys2, token_ids=longer))
    drain(engine)
    published = engine.publish_kv_events(3.0)
    assert published is not None and published[0] == 1
    (stored,) = published[1].events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == keys2[5:] and stored.parent_block_hash == keys2[4]
    assert stored.token_ids == tuple(longer[5 * BS : len(keys2) * BS])
    # The wire round trip keeps every field.
    assert decode_batch(encode_batch(published[1])) == published[1]


def test_evictions_are_one_event_per_block_and_a_reset_clears_all() -> None:
    engine = recording(kv=6 * BS)
    a = chain_hashes((1, i) for i in range(4))
    engine.submit(Sequence("a", 4 * BS, 1, block_hashes=a))
    drain(engine)
    engine.publish_kv_events(0.0)
    engine.submit(Sequence("b", 5 * BS - 1, 1))  # needs 5 blocks: 3 cached ones must go, tail first
    drain(engine)
    _, batch = engine.publish_kv_events(1.0) or (0, None)
    assert batch is not None
    assert batch.events == tuple(BlockRemoved((h,), MEDIUM_GPU, 0) for h in (a[3], a[2], a[1]))
    assert engine.cache is not None and engine.cache.clear()
    _, batch = engine.publish_kv_events(2.0) or (0, None)
    assert batch is not None and batch.events == (AllBlocksCleared(),)


def test_a_referenced_block_refuses_a_reset() -> None:
    engine = recording()
    a = chain_hashes((1, i) for i in range(4))
    engine.submit(Sequence("a", 4 * BS + 1, 50, block_hashes=a))
    engine.finish_step(engine.plan_step(0.0), 0.05, 0.05)  # type: ignore[arg-type]
    assert engine.cache is not None and not engine.cache.clear() and engine.cache.match(a) == 4


def test_no_caching_no_events() -> None:
    engine = recording(caching=False)
    engine.submit(Sequence("a", 10 * BS, 1, block_hashes=chain_hashes(range(10))))
    drain(engine)
    assert engine.publish_kv_events(0.0) is None and engine.kv_seq is None


def test_the_engines_events_rebuild_its_cache_in_the_gateways_index() -> None:
    rng = random.Random(7)
    engine = recording(kv=40 * BS)
    index = PrefixIndex(capacity_blocks=1000, stale_after_s=1e9)
    index.add_node("n0", 0.0)
    stream = EventStreamSync(index, "n0")
    conversations = [[rng.randrange(50_000) for _ in range(30 * BS)] for _ in range(5)]
    t = 0.0
    for i in range(60):
        tokens = rng.choice(conversations)[: rng.randint(20, 300)]
        keys = tuple(block_keys(tokens, BS))
        engine.submit(Sequence(f"r{i}", len(tokens), rng.randint(1, 60), block_hashes=keys, token_ids=tokens))
        for _ in range(rng.randint(1, 8)):
            plan = engine.plan_step(t)
            if plan is None:
                break
            t += 0.05
            engine.finish_step(plan, t, 0.05)
        published = engine.publish_kv_events(t)
        if published is not None:
            seq, batch = published
            assert stream.on_live(seq, decode_batch(encode_batch(batch)), t) is None
        for conv in conversations:
            keys = block_keys(conv, BS)
            cap = (len(conv) - 1) // BS
            assert prompt_prefix_hits(index, conv, t)["n0"] == engine.prefix_hit(tuple(keys), len(conv)) <= cap * BS
    assert engine.kv_seq is not None and index.stats("n0").resets == 0 and stream.gaps == 0


def test_a_batch_is_numbered_and_timestamped_as_the_publisher_would() -> None:
    engine = recording()
    for i in range(3):
        engine.submit(Sequence(f"r{i}", 2 * BS, 1, block_hashes=chain_hashes((i, b) for b in range(2))))
        drain(engine)
        seq, batch = engine.publish_kv_events(float(i)) or (None, None)
        assert seq == i and isinstance(batch, KvEventBatch) and batch.ts == float(i)


@pytest.mark.parametrize("spec", ["kairos", "pd"])
def test_the_simulator_decides_on_the_index_of_the_events(spec: str) -> None:
    models = load_profile()
    reqs = make_workload("multiturn", rps=12, duration_s=60, seed=3)
    runs = {}
    for index in (False, True):
        sim = Simulator(reqs, create_policy(spec, models), models, ClusterConfig(prefix_index=index))
        runs[index] = sim.run().summary
        if index:
            assert sim.prefix_index is not None and set(sim.prefix_index.nodes()) == set(sim.engines)
            assert all(sim.prefix_index.stats(n).cached_blocks > 0 for n in sim.engines)
            assert all(s.gaps == 0 for s in sim._kv_streams.values())
    # The index lags the caches by up to a heartbeat; what it sees differs little from the truth.
    assert runs[True]["tbt_violation_rate"] == 0.0
    assert runs[True]["prefix_hit_rate_decode"] > 0.5 and runs[False]["prefix_hit_rate_decode"] > 0.5
    assert abs(runs[True]["prefix_hit_rate_decode"] - runs[False]["prefix_hit_rate_decode"]) < 0.05
