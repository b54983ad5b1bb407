"""kairos.core.prefix_index: per-node prefix residency from KV events, bounded, with stale nodes
reading zero; and kairos.core.kv_event_sync: sequence gaps, replays, restarts and resets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kairos.common.block_hash import block_keys
from kairos.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from kairos.core.kv_event_sync import EventStreamSync, ReplayRequest
from kairos.core.prefix_index import PrefixIndex, prompt_prefix_hits

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4
KEYS = block_keys(PROMPT, BS)


def stored(keys: list[int], parent: int | None = None, block_size: int = BS, **kw: object) -> BlockStored:
    return BlockStored(tuple(keys), parent, tuple(range(len(keys) * block_size)), block_size, None, "GPU", None, **kw)


def batch(*events: object) -> KvEventBatch:
    return KvEventBatch(0.0, tuple(events), 0)  # type: ignore[arg-type]


def index(*nodes: str, capacity: int = 1000) -> PrefixIndex:
    ix = PrefixIndex(capacity_blocks=capacity, stale_after_s=1.0)
    for n in nodes:
        ix.add_node(n, now=0.0)
    return ix


def hits(ix: PrefixIndex, now: float = 0.5, prompt: list[int] = PROMPT) -> dict[str, int]:
    return ix.longest_prefix_tokens({bs: block_keys(prompt, bs) for bs in ix.block_sizes()}, now)


# -- the index ----------------------------------------------------------------------------------
def test_longest_prefix_per_node() -> None:
    ix = index("p0", "d0", "d1")
    ix.apply("p0", [stored(KEYS[:3]), stored(KEYS[3:8], parent=KEYS[2])], 0.1)
    ix.apply("d0", [stored(KEYS[:5])], 0.1)
    ix.apply("d1", [stored(KEYS[1:8])], 0.1)  # no first block: vLLM could not hit any of it
    assert hits(ix) == {"p0": 32, "d0": 20, "d1": 0}
    assert hits(ix, prompt=PROMPT[:18]) == {"p0": 16, "d0": 16, "d1": 0}  # only full blocks
    assert hits(ix, prompt=[7, *PROMPT[1:]]) == {"p0": 0, "d0": 0, "d1": 0}


def test_removed_block_ends_the_prefix_and_clear_forgets() -> None:
    ix = index("d0")
    ix.apply("d0", [stored(KEYS), BlockRemoved((KEYS[2],), "GPU")], 0.1)
    assert hits(ix) == {"d0": 8}
    ix.apply("d0", [AllBlocksCleared()], 0.2)
    assert hits(ix) == {"d0": 0}
    assert ix.stats("d0").cached_blocks == 0 and ix.stats("d0").resets == 1
    ix.apply("d0", [stored(KEYS[:2])], 0.3)
    assert hits(ix) == {"d0": 8}


def test_digest_hashes_key_as_their_low_64_bits() -> None:
    ix = index("d0")
    digests = [k.to_bytes(8, "big").rjust(32, b"\x01") for k in KEYS[:2]]
    ix.apply("d0", [stored(digests)], 0.1)  # type: ignore[arg-type]
    assert hits(ix) == {"d0": 8}


def test_capacity_drops_the_oldest_stored() -> None:
    ix = index("d0", "d1", capacity=4)
    ix.apply("d0", [stored(KEYS[:4])], 0.1)
    ix.apply("d0", [stored(KEYS[:1])], 0.1)  # block 0 stored again: now the newest
    ix.apply("d0", [stored(KEYS[4:6])], 0.1)  # drops blocks 1 and 2
    ix.apply("d1", [stored(KEYS[:2])], 0.1)
    s = ix.stats("d0")
    assert (s.cached_blocks, s.evicted_blocks) == (4, 2)
    assert hits(ix) == {"d0": 4, "d1": 8}  # d1's copy of block 1 is untouched


def test_stale_or_out_of_step_node_reads_zero() -> None:
    ix = index("d0", "d1")
    ix.apply("d0", [stored(KEYS)], 0.1)
    ix.apply("d1", [stored(KEYS)], 0.1)
    assert hits(ix, now=1.1) == {"d0": 32, "d1": 32}
    assert hits(ix, now=1.2) == {"d0": 0, "d1": 0}  # 1.1 s without an event or a touch
    ix.touch("d0", 1.2)
    assert hits(ix, now=1.3) == {"d0": 32, "d1": 0}
    ix.set_synced("d0", False)
    assert hits(ix, now=1.3) == {"d0": 0, "d1": 0}


def test_other_groups_media_and_block_sizes_are_ignored() -> None:
    ix = index("d0")
    ix.apply("d0", [stored(KEYS[:2])], 0.1)
    ix.apply(
        "d0",
        [
            stored(KEYS[2:4], group_idx=1),
            BlockStored((KEYS[2],), KEYS[1], (0,) * 4, 4, None, "CPU", None),
            stored(block_keys(PROMPT, 8)[1:3], block_size=8),
            BlockRemoved((KEYS[0],), "CPU"),
        ],
        0.2,
    )
    assert hits(ix) == {"d0": 8}
    assert ix.stats("d0").ignored_events == 4
    assert ix.block_sizes() == {4}


def test_nodes_at_several_block_sizes() -> None:
    ix = index("a", "b")
    ix.apply("a", [stored(KEYS[:3])], 0.1)
    ix.apply("b", [stored(block_keys(PROMPT, 8)[:4], block_size=8)], 0.1)
    assert hits(ix) == {"a": 12, "b": 32}
    assert ix.longest_prefix_tokens({BS: KEYS}, 0.5) == {"a": 12, "b": 0}  # b's size not given


def test_the_block_sizes_follow_each_nodes_first_store_its_resets_and_its_removal() -> None:
    """Kept as nodes change, not gathered per request: an index with no size set is the
    dispatcher's count-only path (no token ids), so a reset or a removal must take a size away."""
    ix = index("a", "b")
    assert ix.block_sizes() == frozenset()
    ix.apply("a", [stored(KEYS[:1])], 0.1)
    ix.apply("b", [stored(block_keys(PROMPT, 8)[:1], block_size=8)], 0.1)
    assert ix.block_sizes() == {4, 8}
    ix.apply("b", [AllBlocksCleared()], 0.2)
    assert ix.block_sizes() == {4}
    ix.apply("b", [stored(KEYS[:2])], 0.3)  # after a reset a node may come back at another size
    ix.remove_node("a")
    assert ix.block_sizes() == {4}
    ix.clear("b")
    assert ix.block_sizes() == frozenset()


def test_remove_node_frees_its_slot_and_blocks() -> None:
    ix = index("a", "b")
    ix.apply("a", [stored(KEYS)], 0.1)
    ix.apply("b", [stored(KEYS[:1])], 0.1)
    ix.remove_node("a")
    ix.add_node("c", 0.2)  # takes a's slot: must not inherit a's blocks
    assert hits(ix) == {"b": 4, "c": 0}
    ix.remove_node("b")
    assert ix._holders == {}


def test_capacity_checked() -> None:
    with pytest.raises(ValueError, match="capacity_blocks=0 must be >= 1"):
        PrefixIndex(capacity_blocks=0)


# -- the stream ---------------------------------------------------------------------------------
def one(i: int) -> KvEventBatch:
    """Batch that stores block i of the prompt."""
    return batch(stored([KEYS[i]], parent=KEYS[i - 1] if i else None))


def stream() -> tuple[PrefixIndex, EventStreamSync]:
    ix = index("d0")
    return ix, EventStreamSync(ix, "d0", max_pending=3)


def test_in_order_batches_apply() -> None:
    ix, s = stream()
    assert [s.on_live(i, one(i), 0.1) for i in range(4)] == [None] * 4
    assert hits(ix) == {"d0": 16} and s.last_seq == 3


def test_gap_asks_replay_holds_live_and_reads_zero_until_repaired() -> None:
    ix, s = stream()
    s.on_live(0, one(0), 0.1)
    assert s.on_live(3, one(3), 0.1) == ReplayRequest(1)
    assert s.on_live(4, one(4), 0.1) is None  # held while the replay is outstanding
    assert hits(ix) == {"d0": 0}
    s.on_replay([(0, one(0)), (1, one(1)), (2, one(2)), (3, one(3))], 0.2)
    assert hits(ix) == {"d0": 20} and s.last_seq == 4 and s.gaps == 1
    assert ix.stats("d0").resets == 0


def test_replay_that_no_longer_has_the_gap_resets() -> None:
    ix, s = stream()
    s.on_live(0, batch(stored(KEYS[:6])), 0.1)
    assert s.on_live(5, batch(BlockRemoved((KEYS[7],), "GPU")), 0.1) == ReplayRequest(1)
    s.on_replay([(4, batch(stored([KEYS[6]], KEYS[5])))], 0.2)  # 1..3 gone: they may have removed blocks
    assert hits(ix) == {"d0": 0}
    assert ix.stats("d0").cached_blocks == 1 and ix.stats("d0").resets == 1 and s.last_seq == 5


def test_failed_replay_resets_and_applies_the_held_batches() -> None:
    ix, s = stream()
    s.on_live(0, one(0), 0.1)
    s.on_live(2, batch(stored(KEYS[:3])), 0.1)
    s.on_replay_failed(0.2)
    assert hits(ix) == {"d0": 12} and ix.stats("d0").resets == 1 and s.replaying is None


def test_held_batches_are_bounded() -> None:
    ix, s = stream()
    s.on_live(0, one(0), 0.1)
    assert s.on_live(2, one(2), 0.1) == ReplayRequest(1)
    for seq in range(3, 8):
        s.on_live(seq, batch(stored(KEYS[: seq - 2])), 0.1)
    assert sorted(s._pending) == [5, 6, 7]
    s.on_replay([(1, one(1)), (2, one(2)), (3, one(3)), (4, one(4))], 0.2)
    assert s.last_seq == 7 and hits(ix) == {"d0": 20}


def test_restart_clears_and_starts_over() -> None:
    ix, s = stream()
    for i in range(4):
        s.on_live(i, one(i), 0.1)
    assert s.on_live(0, batch(stored([KEYS[0]])), 0.2) is None  # a new process: seq 0 again
    assert hits(ix) == {"d0": 4} and ix.stats("d0").resets == 1 and s.last_seq == 0
    assert s.on_live(1, one(1), 0.2) is None
    assert s.on_live(1, batch(), 0.3) == ReplayRequest(0)  # restarted again, its batch 0 missed
    assert hits(ix) == {"d0": 0}


def test_disconnect_clears_and_reconnect_replays_from_zero() -> None:
    ix, s = stream()
    s.on_live(0, one(0), 0.1)
    s.on_disconnect(0.2)
    assert hits(ix) == {"d0": 0} and s.last_seq is None
    assert s.on_connect(0.3) == ReplayRequest(0)
    assert s.on_connect(0.3) is None  # one replay at a time
    s.on_replay([(0, one(0)), (1, one(1))], 0.4)
    assert hits(ix) == {"d0": 8}
    assert s.on_connect(0.5) is None  # in step: nothing to rebuild


def test_join_mid_stream_replays_what_the_publisher_buffers() -> None:
    ix, s = stream()
    assert s.on_live(50, one(3), 0.1) == ReplayRequest(0)
    s.on_replay([(48, one(1)), (49, one(2))], 0.2)  # buffer starts at 48: a subset, never a wrong hit
    assert s.last_seq == 50 and ix.stats("d0").cached_blocks == 3 and hits(ix) == {"d0": 0}


def test_prompt_prefix_hits_hashes_at_each_nodes_block_size() -> None:
    ix = index("a", "b")
    ix.apply("a", [stored(KEYS[:2])], 0.1)
    ix.apply("b", [stored(block_keys(PROMPT, 16)[:1], block_size=16)], 0.1)
    assert prompt_prefix_hits(ix, PROMPT, 0.5) == {"a": 8, "b": 16}
    assert prompt_prefix_hits(ix, PROMPT[:15], 0.5) == {"a": 8, "b": 0}
    ix.apply("b", [stored(block_keys(PROMPT, 16)[:2], block_size=16)], 0.1)
    assert prompt_prefix_hits(ix, PROMPT, 0.5) == {"a": 8, "b": 16}  # never the last token: 32 is 2 full blocks
    assert prompt_prefix_hits(ix, [*PROMPT, 0], 0.5) == {"a": 8, "b": 32}


def test_the_walk_reads_keys_no_further_than_the_first_block_no_node_holds() -> None:
    ix = index("a", "b")
    ix.apply("a", [stored(KEYS[:2])], 0.1)
    ix.apply("b", [stored(KEYS[:3])], 0.1)
    read: list[int] = []

    def keys() -> Iterator[int]:
        for k in KEYS:
            read.append(k)
            yield k

    assert ix.longest_prefix_tokens({BS: keys()}, 0.5) == {"a": 8, "b": 12}
    assert read == KEYS[:4]  # block 3 is the first no node holds: blocks 4-7 are never hashed


def test_a_connected_node_stays_fresh_without_events() -> None:
    ix = index("d0")
    ix.apply("d0", [stored(KEYS)], 0.1)
    ix.set_connected("d0", True, 0.1)
    assert hits(ix, now=50.0) == {"d0": 32}  # idle, connection up: its cache is still there
    ix.set_connected("d0", False, 50.0)
    assert hits(ix, now=51.0) == {"d0": 32} and hits(ix, now=51.1) == {"d0": 0}
