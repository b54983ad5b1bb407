"""Prefix-cache block hashes of a prompt, exactly as a vLLM node computes them.

One function for every side that needs them: the dispatcher hashes a prompt's token ids to look
its blocks up in the nodes' indexes (:mod:`kairos.core.prefix_index`), and the emulated node
hashes to publish the same keys a real vLLM publishes (:mod:`kairos.common.kv_events`).

vLLM 0.32's default ``--prefix-caching-hash-algo sha256``: block ``i`` (``block_size`` tokens,
full blocks only) hashes to ``sha256(pickle.dumps((parent, tuple(tokens), extra_keys),
protocol=5))``, where ``parent`` is the previous block's 32-byte digest and, for the first
block, ``NONE_HASH = sha256(pickle.dumps("vllm-none-hash", protocol=5))``. Chosen over
``sha256_cbor`` because it is vLLM's default, and it reproduces exactly here: CPython's pickle is
the same serializer vLLM runs (``tests/unit/test_block_hash.py`` checks digests vLLM itself
computed). On the wire and in every index a block is the digest's low 64 bits, big-endian
(:func:`kairos.common.kv_events.block_key`).

Not covered, each counted as a miss (a hit of zero, never a wrong hit): a node with
``PYTHONHASHSEED`` set (vLLM then seeds ``NONE_HASH`` with it: pass the same value as ``seed``),
requests with ``cache_salt``, LoRA adapters or multimodal inputs (their ``extra_keys`` are not
None), and the xxhash algorithms (randomly seeded per process).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Sequence
from functools import lru_cache

NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for the first block's parent
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on CPython 3.8+, what vLLM passes


def _sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


@lru_cache(maxsize=8)
def none_hash(seed: str = NONE_HASH_SEED) -> bytes:
    """The digest a prompt's first block takes as its parent."""
    return _sha256_pickle(seed)


def iter_block_digests(token_ids: Sequence[int], block_size: int, seed: str = NONE_HASH_SEED) -> Iterator[bytes]:
    """The 32-byte digests of the prompt's full blocks, in order (a partial last block has none),
    each computed when asked for: a lookup that stops at its first miss hashes no further."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    parent = none_hash(seed)
    dumps, sha256 = pickle.dumps, hashlib.sha256
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256(dumps((parent, tuple(token_ids[start : start + block_size]), None), _PICKLE_PROTOCOL)).digest()
        yield parent


def iter_block_keys(token_ids: Sequence[int], block_size: int, seed: str = NONE_HASH_SEED) -> Iterator[int]:
    """The prompt's full blocks as index keys, lazily: each digest's low 64 bits, as vLLM
    publishes them."""
    for digest in iter_block_digests(token_ids, block_size, seed):
        yield int.from_bytes(digest[-8:], "big")


def block_digests(token_ids: Sequence[int], block_size: int, seed: str = NONE_HASH_SEED) -> list[bytes]:
    return list(iter_block_digests(token_ids, block_size, seed))


def block_keys(token_ids: Sequence[int], block_size: int, seed: str = NONE_HASH_SEED) -> list[int]:
    return list(iter_block_keys(token_ids, block_size, seed))
