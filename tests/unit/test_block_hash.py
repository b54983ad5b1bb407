"""kairos.common.block_hash against digests vLLM 0.32 computed itself (vllm.v1.core.kv_cache_utils
.hash_block_tokens with vllm.utils.hashing.sha256 after init_none_hash, PYTHONHASHSEED unset)."""

from __future__ import annotations

import pytest

from kairos.common.block_hash import block_digests, block_keys, none_hash

VLLM_NONE_HASH = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
VLLM_DIGESTS = [
    "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf",  # tokens 1..16
    "8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577",  # 17..32
    "a60f8dd239bbbdfb22ed37b12d0961e74bd744ea8006d6e8af0a75ea38d2abba",  # 100000..100015
]
VLLM_KEYS = [1403909460543360175, 1643945449041937783, 12613023355240623034]  # as it publishes them
PROMPT = list(range(1, 33)) + [100_000 + i for i in range(16)]


def test_none_hash_is_vllms() -> None:
    assert none_hash().hex() == VLLM_NONE_HASH
    assert none_hash("42") != none_hash()


def test_digests_and_keys_are_vllms() -> None:
    assert [d.hex() for d in block_digests(PROMPT, 16)] == VLLM_DIGESTS
    assert block_keys(PROMPT, 16) == VLLM_KEYS


def test_only_full_blocks_and_chaining() -> None:
    assert block_keys(PROMPT + [5] * 15, 16) == VLLM_KEYS  # a partial block has no hash
    assert block_keys(PROMPT[:15], 16) == []
    assert block_keys(PROMPT, 48) != block_keys(PROMPT, 16)[:1]
    changed = [0, *PROMPT[1:]]
    assert all(
        a != b for a, b in zip(block_keys(changed, 16), VLLM_KEYS, strict=True)
    )  # a change moves every later hash


def test_block_size_checked() -> None:
    with pytest.raises(ValueError, match="block_size=0 must be >= 1"):
        block_keys(PROMPT, 0)
