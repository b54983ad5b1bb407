"""Which prompt prefixes each node holds in its prefix cache, from the node's own KV events.

Pure: no clock, no I/O. The consumer (:mod:`extproc.kv_events`) applies each node's event
batches in sequence order (:mod:`kairos.core.kv_event_sync` decides the order, the gaps and the
resets); the dispatcher asks, for a prompt's chain of block keys
(:func:`kairos.common.block_hash.block_keys`), how many of its leading tokens each node holds.

Every rule keeps the index a subset of what the node really holds, so a lookup can under-count
a hit, never report one the node will not have: a reset drops a node's blocks, the capacity
drops its oldest, and a node whose index is not in step with its stream (a gap not yet repaired)
or not heard from within ``stale_after_s`` (its event connection down, and no event or
:meth:`PrefixIndex.touch` from a heartbeat since) reports a hit of zero, as a stale heartbeat
makes a node ineligible.

Memory: a node's blocks are an ordered dict of 64-bit keys (the eviction order), and every key
maps once, for all nodes, to a bit mask of the nodes holding it, so the lookup walks the prompt's
blocks once whatever the number of nodes: ``O(blocks x nodes / 64)``.

Indexed: the first KV cache group (``group_idx`` 0 or absent) on the GPU medium (``medium`` "GPU"
or absent), at the block size of the node's first stored event after a reset; events for other
groups, offload tiers, or another block size (vLLM's partial blocks) are counted in
:attr:`NodeStats.ignored_events` and not applied.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kairos.common import defaults
from kairos.common.block_hash import iter_block_keys
from kairos.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, block_key

_INDEXED_MEDIA = (None, "GPU")
_INDEXED_GROUPS = (None, 0)


@dataclass(slots=True)
class NodeStats:
    """One node's index, for tests, metrics and operators."""

    cached_blocks: int
    block_size: int | None
    synced: bool
    connected: bool
    last_seen: float
    resets: int  # clears: AllBlocksCleared, restarts, holes no replay repaired
    evicted_blocks: int  # dropped by the capacity, not by the node
    ignored_events: int


@dataclass(slots=True)
class _Node:
    slot: int  # its bit in the holder masks
    last_seen: float
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest stored first
    block_size: int | None = None
    synced: bool = True
    connected: bool = False  # its event stream's connection is up (ZMQ heartbeats watch it)
    resets: int = 0
    evicted_blocks: int = 0
    ignored_events: int = 0


class PrefixIndex:
    """Per-node prefix-cache residency, bounded to ``capacity_blocks`` blocks per node."""

    def __init__(
        self,
        capacity_blocks: int = defaults.PREFIX_INDEX_CAPACITY_BLOCKS,
        stale_after_s: float = defaults.STALE_AFTER_S,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks={capacity_blocks} must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.stale_after_s = stale_after_s
        self._nodes: dict[str, _Node] = {}
        self._by_slot: dict[int, str] = {}
        self._holders: dict[int, int] = {}  # block key -> mask of the slots holding it
        self._free_slots: list[int] = []
        # Nodes per block size, kept as nodes set and reset theirs: the request path asks for the
        # sizes twice a request, which must not cost a pass over 1,000 nodes.
        self._sizes: Counter[int] = Counter()
        self._size_set: frozenset[int] = frozenset()

    # -- membership ------------------------------------------------------------------------------
    def add_node(self, node_id: str, now: float) -> None:
        """Start indexing a node (idempotent): empty, in step, seen ``now``."""
        if node_id in self._nodes:
            return
        slot = self._free_slots.pop() if self._free_slots else len(self._by_slot)
        self._nodes[node_id] = _Node(slot, now)
        self._by_slot[slot] = node_id

    def remove_node(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        self._set_block_size(node, None)
        self._drop_all(node)
        del self._by_slot[node.slot]
        self._free_slots.append(node.slot)

    def nodes(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    def stats(self, node_id: str) -> NodeStats:
        n = self._nodes[node_id]
        return NodeStats(
            len(n.blocks),
            n.block_size,
            n.synced,
            n.connected,
            n.last_seen,
            n.resets,
            n.evicted_blocks,
            n.ignored_events,
        )

    # -- updates ---------------------------------------------------------------------------------
    def touch(self, node_id: str, now: float) -> None:
        """The node is alive (a heartbeat, or its event connection is up) though it sent no event."""
        node = self._nodes.get(node_id)
        if node is not None and now > node.last_seen:
            node.last_seen = now

    def set_connected(self, node_id: str, connected: bool, now: float) -> None:
        """The node's event stream connected or lost: while connected the node is fresh without
        events (an idle node sends none, and a dead peer's connection drops within its
        heartbeat timeout); from the loss on it ages from ``now``."""
        node = self._nodes[node_id]
        node.connected = connected
        node.last_seen = max(node.last_seen, now)

    def set_synced(self, node_id: str, synced: bool) -> None:
        """Out of step (a gap being repaired): the node's hits read zero until it is back in step."""
        self._nodes[node_id].synced = synced

    def clear(self, node_id: str) -> None:
        """Forget the node's blocks (a reset); its next stored event sets its block size again."""
        node = self._nodes[node_id]
        self._drop_all(node)
        self._set_block_size(node, None)
        node.resets += 1

    def apply(self, node_id: str, events: Iterable[KvEvent], now: float) -> None:
        """Apply one batch's events, in order."""
        node = self._nodes[node_id]
        node.last_seen = max(node.last_seen, now)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(node, event)
            elif isinstance(event, BlockRemoved):
                if event.medium not in _INDEXED_MEDIA or event.group_idx not in _INDEXED_GROUPS:
                    node.ignored_events += 1
                    continue
                self._remove(node, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(node_id)

    def _store(self, node: _Node, event: BlockStored) -> None:
        if event.medium not in _INDEXED_MEDIA or event.group_idx not in _INDEXED_GROUPS:
            node.ignored_events += 1
            return
        if node.block_size is None:
            self._set_block_size(node, event.block_size)
        elif event.block_size != node.block_size:
            node.ignored_events += 1
            return
        bit = 1 << node.slot
        blocks, holders = node.blocks, self._holders
        for wire in event.block_hashes:
            key = block_key(wire)
            if key in blocks:
                blocks.move_to_end(key)  # stored again: the newest
                continue
            blocks[key] = None
            holders[key] = holders.get(key, 0) | bit
        while len(blocks) > self.capacity_blocks:
            key, _ = blocks.popitem(last=False)
            self._unhold(key, bit)
            node.evicted_blocks += 1

    def _set_block_size(self, node: _Node, size: int | None) -> None:
        if node.block_size == size:
            return
        if node.block_size is not None:
            self._sizes[node.block_size] -= 1
            if not self._sizes[node.block_size]:
                del self._sizes[node.block_size]
        if size is not None:
            self._sizes[size] += 1
        node.block_size = size
        self._size_set = frozenset(self._sizes)

    def _remove(self, node: _Node, hashes: Iterable[int | bytes]) -> None:
        bit = 1 << node.slot
        for wire in hashes:
            key = block_key(wire)
            if node.blocks.pop(key, 0) is None:  # present (its value is None)
                self._unhold(key, bit)

    def _unhold(self, key: int, bit: int) -> None:
        mask = self._holders[key] & ~bit
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def _drop_all(self, node: _Node) -> None:
        bit = 1 << node.slot
        for key in node.blocks:
            self._unhold(key, bit)
        node.blocks.clear()

    # -- lookup ----------------------------------------------------------------------------------
    def block_sizes(self) -> frozenset[int]:
        """The block sizes the nodes hash at: the prompt's keys are needed at each of these."""
        return self._size_set

    def fresh(self, node_id: str, now: float) -> bool:
        node = self._nodes[node_id]
        return node.synced and (node.connected or now - node.last_seen <= self.stale_after_s)

    def longest_prefix_tokens(self, keys_by_block_size: Mapping[int, Iterable[int]], now: float) -> dict[str, int]:
        """Per node, the prompt's leading tokens it holds in full blocks (0 when stale, out of
        step, or at a block size not given). vLLM computes at least the prompt's last token, so
        a request's hit is at most ``prompt_tokens - 1`` rounded down to a block: the caller caps.
        Keys are read in order and no further than the first block no fresh node holds, so a
        lazy iterable (:func:`~kairos.common.block_hash.iter_block_keys`) hashes no more."""
        hits = dict.fromkeys(self._nodes, 0)
        groups: dict[int, int] = {}
        for node_id, node in self._nodes.items():
            if node.block_size in keys_by_block_size and self.fresh(node_id, now):
                groups[node.block_size] = groups.get(node.block_size, 0) | (1 << node.slot)
        holders = self._holders
        for block_size, alive in groups.items():
            keys = keys_by_block_size[block_size]
            depth = 0
            for key in keys:
                held = holders.get(key, 0) & alive
                if held != alive:
                    self._credit(hits, alive & ~held, depth * block_size)
                    alive = held
                    if not alive:
                        break
                depth += 1
            self._credit(hits, alive, depth * block_size)
        return hits

    def _credit(self, hits: dict[str, int], mask: int, tokens: int) -> None:
        while mask:
            low = mask & -mask
            hits[self._by_slot[low.bit_length() - 1]] = tokens
            mask ^= low


def prompt_prefix_hits(index: PrefixIndex, token_ids: Sequence[int], now: float) -> dict[str, int]:
    """Per node, the prompt tokens vLLM will find cached there: the prompt hashed per block size
    the nodes use (:func:`kairos.common.block_hash.iter_block_keys`), as far as the walk of the
    index goes (up to the first block no fresh node holds).
    As vLLM, never the prompt's last token (it is always computed): the blocks of all tokens but
    the last, so a prompt of exactly ``k`` full blocks hits at most ``k - 1``."""
    head = token_ids[:-1]
    keys = {size: iter_block_keys(head, size) for size in index.block_sizes()}
    return index.longest_prefix_tokens(keys, now)
