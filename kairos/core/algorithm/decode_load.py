"""How loaded a decode node is: the batch it holds once what is on its way has joined, and the
decode-only step time of that batch (the keep path's least-load measure, the overload rule's and
the decode pressure rule's)."""

from __future__ import annotations

from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState


def committed_batch(node: DecodeNodeState) -> tuple[int, int]:
    """The decodes and KV tokens ``node`` holds once what is on its way has joined: its running
    decodes, its deflected backlog, the keeps whose KV it is pulling (each joins the batch once
    pulled, within a link's time) and the keeps incoming from a prefill node."""
    backlog, pulls = node.prefill_backlog_tokens, node.pending_kv_pull_tokens
    return (
        node.decode_tokens + len(backlog) + len(pulls) + node.incoming_keeps,
        node.kv_tokens + sum(backlog) + sum(pulls) + node.incoming_keep_tokens,
    )


def decode_load_s(models: LatencyModels, node: DecodeNodeState) -> float:
    """The keep path's least-load measure, and the overload rule's: the predicted decode-only
    step time T0(B, K) of the node's committed batch (``committed_batch``). It is the TBT a newly
    arriving decode would see, so it weighs batch size and KV occupancy the way the hardware
    does, in one number."""
    return models.decode_step_s(*committed_batch(node))


def decode_load_after_s(models: LatencyModels, node: DecodeNodeState, prompt_tokens: int) -> float:
    """``decode_load_s`` with the request joined: the decode-only step the node runs once the
    request decodes there, on either path (the decode pressure rule's measure)."""
    b, k = committed_batch(node)
    return models.decode_step_s(b + 1, k + prompt_tokens)
