"""How much of a decode hop's prompt the prefill node computed: the split route's k, read from the
``kv_transfer_params`` that hop 1's answer carries (vLLM-free, so it is tested without vLLM).

Hop 1 of a split sends the prefill node the prompt's first k tokens; vLLM's NixlConnector answers
with ``remote_num_tokens`` = the tokens it computed (k) and the blocks holding their KV. Hop 2
sends the decode node the whole prompt with those params. A keep's hop 1 computed the whole
prompt, so its ``remote_num_tokens`` is the prompt's length: only a count below it is a split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REMOTE_NUM_TOKENS = "remote_num_tokens"  # vLLM's NixlConnector: the prompt tokens the prefiller computed


def split_prefix_tokens(params: Mapping[str, Any] | None, prompt_tokens: int) -> int | None:
    """k, the prompt's leading tokens whose KV the prefill node holds, when ``params`` say it
    computed fewer than the prompt's ``prompt_tokens`` (0 < k < prompt); None otherwise (no
    params, no count, a keep's whole prompt or more, or nothing computed)."""
    if not params:
        return None
    k = params.get(REMOTE_NUM_TOKENS)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k < prompt_tokens:
        return None
    return k
