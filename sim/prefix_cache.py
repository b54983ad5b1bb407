"""A node's prefix cache at block granularity, modelled on vLLM v1's block pool
(``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``; read, not copied).

vLLM keeps the KV cache in blocks of ``block_size`` tokens. A full block gets a hash that
covers its parent block's hash and its own tokens, so equal hashes mean equal prefixes, and a
request's cached prefix is its longest run of leading block hashes present in the cache. A
block is referenced by every running request that uses it; one nobody references stays cached
(and reusable) in a free queue, oldest first, and is evicted from the head of that queue only
when an allocation needs its memory. A request frees its blocks last block first, so a
prompt's tail is evicted before its head.

Here a block is its hash alone: no block ids, no token ids. Callers give each request its
chain of block hashes (see :func:`kairos.traffic.requests.chain_hashes`); the cache counts
references and keeps the free queue. What a block costs in KV memory is the engine's to count
(``sim/engine.py``): a referenced block sits in some running request's KV, a free one only in
:attr:`free_tokens`.

With an ``events`` list it records what vLLM's block pool queues for ``--kv-events-config``,
as :mod:`kairos.common.kv_events` types: a ``BlockStored`` for each ``insert`` (the whole range
the request completed, as ``cache_full_blocks`` reports it, with the parent block's hash and, when
the caller has them, the blocks' token ids), a ``BlockRemoved`` per evicted block, and an
``AllBlocksCleared`` for a reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kairos.common import defaults
from kairos.common.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


def hit_blocks_cap(prompt_tokens: int, block_tokens: int) -> int:
    """The most leading blocks a prompt may take from the cache: vLLM recomputes at least the
    prompt's last token (it needs its logits), so a prompt cached to the last block
    recomputes that block."""
    return (prompt_tokens - 1) // block_tokens


class PrefixCache:
    """Cached blocks by hash: a reference count each, and the unreferenced ones in eviction
    order (least recently freed first)."""

    __slots__ = ("_refs", "block_tokens", "events", "free_queue", "shared_blocks")

    def __init__(self, block_tokens: int = defaults.KV_BLOCK_TOKENS, events: list[KvEvent] | None = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._refs: dict[int, int] = {}  # hash -> running requests that reference the block
        # Unreferenced blocks in eviction order; an OrderedDict pops its head in O(1), where a
        # dict's first key costs a scan past the slots its deletions left.
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        # References beyond each block's first: the KV tokens the running requests count twice
        # (each counts its whole context) that the node holds once.
        self.shared_blocks = 0
        self.events = events  # where the cache's changes are recorded, if anywhere

    # -- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    def refs(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    @property
    def free_tokens(self) -> int:
        """Tokens in cached blocks no request references: evictable, so free for allocation."""
        return len(self.free_queue) * self.block_tokens

    def eviction_order(self) -> list[int]:
        """The unreferenced blocks, the next to be evicted first."""
        return list(self.free_queue)

    def match(self, hashes: Sequence[int], max_blocks: int | None = None) -> int:
        """How many of ``hashes``' leading blocks are cached (at most ``max_blocks``)."""
        refs = self._refs
        n = len(hashes) if max_blocks is None else min(len(hashes), max_blocks)
        for i in range(n):
            if hashes[i] not in refs:
                return i
        return n

    # -- changes ------------------------------------------------------------------------------
    def acquire(self, hashes: Iterable[int]) -> None:
        """A request starts using these cached blocks (vLLM's ``touch``): out of the free queue."""
        refs, free = self._refs, self.free_queue
        for h in hashes:
            r = refs[h]
            if r == 0:
                del free[h]
            else:
                self.shared_blocks += 1
            refs[h] = r + 1

    def insert(self, hashes: Sequence[int], parent: int | None = None, token_ids: Sequence[int] = ()) -> list[int]:
        """A request computed these full blocks (``parent``: the hash of the block before the
        first, None at a prompt's start; ``token_ids``: their tokens, if known): cache the ones
        not cached yet, referenced by it, and return them. A block computed again while an equal
        one was cached stays the request's own (vLLM keeps the first copy and does not cache the
        duplicate); its event still lists it, as vLLM's does."""
        refs = self._refs
        added = [h for h in hashes if h not in refs]
        for h in added:
            refs[h] = 1
        if hashes and self.events is not None:
            self.events.append(
                BlockStored(tuple(hashes), parent, tuple(token_ids), self.block_tokens, None, MEDIUM_GPU, None, None, 0)
            )
        return added

    def release(self, hashes: Sequence[int]) -> None:
        """A request stops using its blocks, given in prefix order: each one nobody references
        any more joins the free queue's tail, the last block first (vLLM frees in reverse, so a
        prefix's tail is evicted before its head)."""
        refs, free = self._refs, self.free_queue
        for h in reversed(hashes):
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                free[h] = None
            else:
                self.shared_blocks -= 1

    def evict(self, blocks: int) -> int:
        """Evict up to ``blocks`` unreferenced blocks from the free queue's head; how many went.
        A prefix whose head is evicted stops matching there, so its tail is dead weight until
        its own turn at the head comes."""
        free, refs = self.free_queue, self._refs
        n = min(blocks, len(free))
        gone = [free.popitem(last=False)[0] for _ in range(n)]
        for h in gone:
            del refs[h]
        if gone and self.events is not None:
            self.events.extend(BlockRemoved((h,), MEDIUM_GPU, 0) for h in gone)  # vLLM: one event per block
        return n

    def clear(self) -> bool:
        """Drop every cached block (vLLM's ``reset_prefix_cache``): only when no request
        references one, else nothing changes and False is returned, as vLLM refuses."""
        if len(self.free_queue) != len(self._refs):
            return False
        self._refs.clear()
        self.free_queue.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
