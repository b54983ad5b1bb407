"""The block-level prefix cache, alone and inside the engine model: hit lengths, the free
queue's order, eviction under KV pressure, references while requests run, and capacity."""

from __future__ import annotations

import pytest

from kairos.common.contracts import Role
from kairos.sim.engine import Engine, EngineConfig, Sequence, StepPlan
from kairos.sim.prefix_cache import PrefixCache, hit_blocks_cap
from kairos.traffic.requests import chain_hashes

BS = 16


def fixed_timer(role: Role, plan: StepPlan) -> float:
    return 0.05


def drain(engine: Engine, limit: int = 1000) -> None:
    t = 0.0
    for _ in range(limit):
        plan = engine.plan_step(t)
        if plan is None:
            return
        t += 0.05
        engine.finish_step(plan, t, 0.05)
    raise AssertionError("engine did not drain")


def make(role: Role = Role.DECODE, kv: int = 100_000, budget: int = 4096) -> Engine:
    return Engine(EngineConfig("n0", role, budget, kv), fixed_timer)


def conv(key: int, blocks: int) -> tuple[int, ...]:
    return chain_hashes((key, i) for i in range(blocks))


# -- the cache alone ----------------------------------------------------------------------------
def test_chained_hashes_tie_a_block_to_its_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3])
    b = chain_hashes([9, 2, 3])
    assert len(a) == 3 and a[0] != b[0]
    assert a[1] != b[1] and a[2] != b[2]  # same tokens after a different first block: a different block
    assert chain_hashes([1, 2, 3, 4])[:3] == a  # a longer prompt extends the chain


def test_match_is_the_longest_cached_prefix() -> None:
    cache = PrefixCache(BS)
    h = conv(1, 5)
    cache.insert(h[:3])
    assert cache.match(h) == 3
    assert cache.match(h, max_blocks=2) == 2
    assert cache.match(conv(2, 5)) == 0
    # A hole stops the match, even with later blocks cached.
    cache.insert(h[4:])
    assert cache.match(h) == 3


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    assert hit_blocks_cap(64, 16) == 3  # 4 full blocks, the last one's last token is recomputed
    assert hit_blocks_cap(65, 16) == 4
    assert hit_blocks_cap(1, 16) == 0


def test_released_blocks_are_evicted_tail_first_and_oldest_first() -> None:
    cache = PrefixCache(BS)
    a, b = conv(1, 3), conv(2, 2)
    cache.insert(a)
    cache.insert(b)
    cache.release(a)
    cache.release(b)
    assert cache.eviction_order() == [a[2], a[1], a[0], b[1], b[0]]
    assert cache.free_tokens == 5 * BS
    assert cache.evict(2) == 2
    assert cache.match(a) == 1 and cache.match(b) == 2
    # A hit takes a free block out of the queue; released again, it goes to the tail.
    cache.acquire(b[:1])
    assert cache.eviction_order() == [a[0], b[1]]
    cache.release(b[:1])
    assert cache.eviction_order() == [a[0], b[1], b[0]]


def test_referenced_blocks_are_never_evicted_and_sharing_is_counted() -> None:
    cache = PrefixCache(BS)
    h = conv(1, 2)
    assert cache.insert(h) == list(h)
    assert cache.insert(h) == []  # computed again while cached: a duplicate, not cached twice
    cache.acquire(h)  # a second request uses them
    assert cache.shared_blocks == 2 and cache.refs(h[0]) == 2
    assert cache.evict(10) == 0
    cache.release(h)
    assert cache.shared_blocks == 0 and cache.free_tokens == 0
    cache.release(h)
    assert cache.free_tokens == 2 * BS
    cache.clear()
    assert len(cache) == 0


# -- inside the engine --------------------------------------------------------------------------
def test_a_request_without_hashes_never_hits() -> None:
    engine = make(Role.PREFILL)
    for name in ("a", "b"):
        seq = Sequence(name, 100, 1)
        engine.submit(seq)
        drain(engine)
        assert seq.cached_hit == 0
    assert engine.cache is not None and len(engine.cache) == 0


def test_a_second_turn_computes_only_its_uncached_tokens() -> None:
    engine = make()
    h = conv(7, 20)  # the conversation after turn 2: 320 tokens
    first = Sequence("t1", 100, 40, block_hashes=h)  # 100 prompt + 40 output: 139 tokens of KV computed
    engine.submit(first)
    drain(engine)
    assert engine.cache is not None and engine.kv_used == 0
    # Prompt blocks (6) and the output's full blocks (139 // 16 = 8) stay cached, all free.
    assert engine.cache.free_tokens == 8 * BS
    second = Sequence("t2", 200, 5, block_hashes=h)
    engine.submit(second)
    assert second.cached_hit == 8 * BS and second.computed == 128
    assert engine.snapshot().queued_prefill_tokens == (72,)  # a heartbeat shows the uncached work
    plan = engine.plan_step(0.0)
    assert plan is not None and [(c.tokens, c.cached) for c in plan.chunks] == [(72, 128)]
    drain(engine)
    assert engine.kv_used == 0 and engine.kv_pinned == 0
    assert engine.prefix_hit(h, 400) == (200 + 5 - 1) // BS * BS


def test_cached_blocks_share_the_capacity_and_the_oldest_free_go_first() -> None:
    engine = make(Role.PREFILL, kv=10 * BS)
    old, new = conv(1, 4), conv(2, 4)
    for name, h in (("old", old), ("new", new)):
        engine.submit(Sequence(name, 4 * BS, 1, block_hashes=h))
        drain(engine)
    cache = engine.cache
    assert cache is not None and cache.free_tokens == 8 * BS  # 8 of 10 blocks hold free cached KV
    assert engine.free_kv_tokens == 10 * BS  # evictable: free for admission
    # A 5-block prompt needs 3 blocks more than are empty: the oldest free ones go, old's tail first.
    big = Sequence("big", 5 * BS - 1, 1, hold_kv=True)
    engine.submit(big)
    plan = engine.plan_step(0.0)
    assert plan is not None
    assert cache.match(old) == 1 and cache.match(new) == 4
    assert engine.kv_used + engine.kv_prefill_pending + cache.free_tokens <= 10 * BS
    engine.finish_step(plan, 0.05, 0.05)
    engine.release(big)


def test_running_requests_pin_their_prefix_and_share_it_once() -> None:
    engine = make(Role.DECODE, kv=20 * BS)
    system = conv(3, 4)  # a 64-token prefix two requests share
    a = Sequence("a", 4 * BS + 10, 100, block_hashes=system)
    engine.submit(a)
    plan = engine.plan_step(0.0)
    assert plan is not None
    engine.finish_step(plan, 0.05, 0.05)  # a's prompt done: its 4 blocks cached, referenced by a
    b = Sequence("b", 4 * BS + 10, 100, block_hashes=system)
    engine.submit(b)
    assert b.cached_hit == 4 * BS
    cache = engine.cache
    assert cache is not None and cache.refs(system[0]) == 2 and cache.shared_blocks == 4
    # Both count the prefix in their KV (attention reads it for each); the node holds it once.
    held = engine.config.kv_capacity_tokens - engine.free_kv_tokens
    assert held == engine.kv_used + engine.kv_pinned - 4 * BS
    assert cache.evict(100) == 0  # nothing is free to evict while they run
    drain(engine)
    assert cache.shared_blocks == 0 and engine.free_kv_tokens == 20 * BS


def test_a_transfer_reserves_only_the_blocks_the_decode_node_lacks() -> None:
    engine = make(Role.DECODE)
    h = conv(5, 12)
    engine.submit(Sequence("t1", 100, 60, block_hashes=h))
    drain(engine)  # 159 tokens computed: 9 full blocks cached
    seq = Sequence("t2", 190, 3, block_hashes=h)
    missing = engine.reserve_transfer(seq)
    assert missing == 190 - 9 * BS and engine.kv_reserved == missing and engine.kv_pinned == 9 * BS
    engine.accept_transferred(seq, missing)
    assert engine.kv_pinned == 0 and engine.kv_reserved == 0 and engine.kv_used == 190
    drain(engine)
    assert engine.kv_used == 0


def test_a_full_node_refuses_a_transfer() -> None:
    engine = make(Role.DECODE, kv=100)
    engine.accept_transferred(Sequence("r", 90, 50), 0)
    assert engine.reserve_transfer(Sequence("t", 20, 1, block_hashes=conv(1, 1))) is None


@pytest.mark.parametrize("caching", [True, False])
def test_caching_off_never_hits(caching: bool) -> None:
    engine = Engine(EngineConfig("n0", Role.PREFILL, 2048, 100_000, prefix_caching=caching), fixed_timer)
    h = conv(1, 10)
    for name in ("a", "b"):
        engine.submit(Sequence(name, 160, 1, block_hashes=h))
        drain(engine)
    assert engine.prefix_hit(h, 160) == (9 * BS if caching else 0)
