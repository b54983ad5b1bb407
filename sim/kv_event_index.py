"""The simulator's prefix index: where a prompt's KV lives, learnt from the simulated nodes'
KV-cache events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in numbered batches), so
a simulated decider can decide from what a dispatcher would know rather than the caches' truth.

Its events carry block hashes only (the engine's chained hashes). The gateway's index,
``kairos.core.prefix_index``, reads vLLM's own wire events (``kairos.common.kv_events``); the two
are one idea in two places until the engine emits vLLM's event types and the simulator feeds
that index (the next step).

Pure and clock-free, like the rest of the core: a :class:`PrefixIndex` holds, per node, the
block hashes the node reported cached, and answers, for a prompt's chain of block hashes, the
longest cached prefix on each node. The events here carry what the index needs of vLLM's
(block hashes only: a block's hash already covers its whole prefix, so neither the parent hash
nor the token ids are needed to match); the wire codec is a separate step.

Safety over reach, as with heartbeats: a node's index that missed a batch (a gap in the batch
numbers) or whose node restarted is reset to empty, so its hits read as zero until events
rebuild it; an index not known complete for ``stale_after_s`` (no batch applied, and no
heartbeat saying the node published nothing more, ``confirm``) reads as zero; and each node's
index holds at most ``max_blocks`` hashes, dropping the oldest stored first (the node evicts
least recently freed first; a block dropped here that the node still holds only loses a hit,
never invents one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

# Per node: 2M blocks is 32M tokens at 16 per block, over 20 A100 nodes' worth of KV here.
DEFAULT_MAX_BLOCKS = 2_000_000


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the node cached (vLLM: computed full blocks, prompt or output)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the node evicted."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The node dropped its whole cache (vLLM's reset_prefix_cache)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One published batch: its number in the node's stream (consecutive from 0 for a node's
    life; a restarted node starts again at 0), when it was sent, and its events in order."""

    seq: int
    sent_at: float
    events: tuple[KvEvent, ...]


class NodePrefixIndex:
    """The block hashes one node reported cached, oldest stored first."""

    __slots__ = ("_blocks", "max_blocks", "next_seq", "resets", "synced_at")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.next_seq: int | None = None  # the batch expected next; None before the first
        self.resets = 0  # times the index was emptied for a gap or a restart
        self.synced_at = -float("inf")  # when the index last held every batch the node had sent

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, batch: KvEventBatch) -> None:
        """Apply a batch. A gap (a batch missed) or a restart (numbering from 0 again) empties
        the index first: the blocks it missed are unknown, and a hit never counted is safe
        where a hit counted wrongly is not."""
        if self.next_seq is not None and batch.seq != self.next_seq:
            if batch.seq < self.next_seq and batch.seq != 0:
                return  # a batch already applied (a replay overlapping the live stream)
            self._blocks.clear()
            self.resets += 1
        blocks = self._blocks
        for event in batch.events:
            if type(event) is BlockStored:
                for h in event.block_hashes:
                    blocks[h] = None
                    blocks.move_to_end(h)
                while len(blocks) > self.max_blocks:
                    blocks.popitem(last=False)
            elif type(event) is BlockRemoved:
                for h in event.block_hashes:
                    blocks.pop(h, None)
            else:
                blocks.clear()
        self.next_seq = batch.seq + 1
        self.synced_at = max(self.synced_at, batch.sent_at)

    def confirm(self, last_seq: int | None, at: float) -> None:
        """The node said (a heartbeat at ``at``) that ``last_seq`` is the last batch it sent
        (None: none yet): if the index has it, the index is complete as of then."""
        if (self.next_seq or 0) == (0 if last_seq is None else last_seq + 1):
            self.synced_at = max(self.synced_at, at)

    def longest_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """How many of the chain's leading blocks the node holds (at most ``max_blocks``)."""
        # The walk runs in C: a 10K-token prompt is 640 lookups on every node, every decision.
        return len(list(takewhile(self._blocks.__contains__, islice(block_hashes, max(0, max_blocks)))))


class PrefixIndex:
    """Every node's :class:`NodePrefixIndex`, and per prompt the cached tokens on each."""

    def __init__(self, block_tokens: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.nodes: dict[str, NodePrefixIndex] = {}

    def apply(self, node_id: str, batches: Iterable[KvEventBatch]) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodePrefixIndex(self.max_blocks)
        for batch in batches:
            node.apply(batch)

    def confirm(self, node_id: str, last_seq: int | None, at: float) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodePrefixIndex(self.max_blocks)
        node.confirm(last_seq, at)

    def forget(self, node_id: str) -> None:
        """A node that left the cluster."""
        self.nodes.pop(node_id, None)

    def cached_tokens(
        self, block_hashes: Sequence[int], prompt_tokens: int, now: float, stale_after_s: float
    ) -> Mapping[str, int]:
        """The prompt tokens each node holds cached: its longest cached prefix, never the
        prompt's last token (a node always computes it), 0 on a node whose index is stale (not
        known complete within ``stale_after_s``)."""
        if not block_hashes:
            return {}
        cap = (prompt_tokens - 1) // self.block_tokens
        out: dict[str, int] = {}
        for node_id, node in self.nodes.items():
            if now - node.synced_at <= stale_after_s:
                hit = node.longest_prefix(block_hashes, cap)
                if hit:
                    out[node_id] = hit * self.block_tokens
        return out
