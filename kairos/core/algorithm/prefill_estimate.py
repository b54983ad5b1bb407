"""The prefill-node TTFT estimator (§4.2): Eq. 1 (queue wait, Eq. 2, plus the request's own
chunks, Eq. 3), and the keep path's prefill end on a node that packs its queue's chunks into
full steps (``packed_prefill_s``, the full keep estimate)."""

from __future__ import annotations

from kairos.core.algorithm.config import DeciderConfig
from kairos.core.latency import LatencyModels
from kairos.core.state import PrefillNodeState


def prefill_queue_wait_s(models: LatencyModels, node: PrefillNodeState) -> float:
    """Eq. 2: (sum l_i / chi_p) steps, each costed over half of its own prompt cached, on
    average: the token-weighted mean of l_i / 2, sum l_i^2 / (2 sum l_i).

    The paper costs every step over half the whole queue (sum l_i / 2), as if the queue were one
    prompt; a chunk attends to its own prompt's prefix only (the multi-chunk steps of
    ``predicted_step_s`` are costed the same way), so that cost grew with the square of the
    queue. Under sustained load it held keep-path requests incoming on their decode node long
    after they had arrived, until the overload line and the promised KV barred every deflection,
    and the prefill queue grew further (Bursty 8 RPS 2P2D: 710 deflections, attainment 21.6%;
    keep-path MAPE 8.5 for P/D, bench/sim/keep_estimate.py). One queued prompt: the paper's, to
    the bit."""
    outstanding = node.outstanding_tokens
    if outstanding == 0:
        return 0.0
    chi_p = node.chunk_tokens
    return outstanding / chi_p * models.prefill_step_s(chi_p, node.squared_tokens / (2 * outstanding))


def prefill_exec_s(models: LatencyModels, prompt_tokens: int, chunk_tokens: int, cached_tokens: int = 0) -> float:
    """Eq. 3: the sum of the request's own chunk steps, chunk i over i x chi_p cached tokens.

    The paper's sum runs i = 0..ceil(l/chi_p), one step too many; we sum the ceil(l/chi_p)
    steps that exist and cost the last one with the tokens it actually carries. With a prefix
    of ``cached_tokens`` in the node's cache, the chunks cover the rest, each over that prefix too.
    """
    total, cached = 0.0, cached_tokens
    while cached < prompt_tokens:
        n = min(chunk_tokens, prompt_tokens - cached)
        total += models.prefill_step_s(n, cached)
        cached += n
    return total


def packed_prefill_s(
    models: LatencyModels, node: PrefillNodeState, prompt_tokens: int, cached_tokens: int = 0, now: float | None = None
) -> float:
    """The keep path's prefill end on prefill node ``node``, from ``now`` (``keep_estimate="full"``;
    Eq. 1's place). The node runs its queue FIFO, packing ``chunk_tokens`` per step across
    prompts (vLLM's chunked prefill). At its heartbeat it was running a step of the queue it
    reported, ``min(reported, chi)`` tokens; the steps after it pack the rest of the queue and then
    the prompt, whose first chunk fills what the queue leaves of its last step. Each step is the
    prefill model of its tokens and its chunks' attention work (``LatencyModels.prefill_steps_s``):
    the queue's (``attention_tokens``: its prompts' computed prefixes exact, where the step
    boundaries fall on them at their mean) and the prompt's own, whose boundaries the queue fixes.
    Eq. 2 and 3 instead cost the queue as whole steps over each prompt's half and start the
    prompt's chunks at a step of their own (Bursty 2P2D with exact inputs: the keep path's prefill
    end off by 3.5% of its TTFT that way, 2.2% this way: bench/sim/prediction_error.py).

    Less what the node has run of the queue it showed (the view's overlay, ``overlay_tokens``, is
    work sent since; a node idle at its heartbeat starts it at once), as far as that queue lasts:
    the step it was running at its heartbeat (``reported_at``) for as long as the node says it had
    (``running_step_elapsed_s``; half the step on average where it does not say), and the
    heartbeat's age since. With ``now`` None the heartbeat is taken as current. (Half a step for
    every node left the keep path's prefill end off by 1.7-2.2% of its TTFT on Bursty 2P2D at 3-8
    RPS with exact inputs; with the step's phase said, 0.2%: bench/sim/prediction_error.py,
    docs/measurements/2026-12-07-sim-step-phase.md.)"""
    chi = node.chunk_tokens
    facts = node.derived
    if facts is None or facts[0] is not models:
        facts = _queue_facts(models, node)
        object.__setattr__(node, "derived", facts)
    _, packed, after_attention, running_s, shown_s = facts
    # The prompt's own attention, its chunks cut where the queue leaves off: computed prefix x
    # its tokens, plus each pair of its chunks (the later over the earlier's tokens).
    work = prompt_tokens - cached_tokens
    first = min(work, chi - packed % chi)
    full, rest = divmod(work - first, chi)
    own = cached_tokens * work + (work * work - first * first - full * chi * chi - rest * rest) // 2
    after = models.prefill_steps_s(packed + work, chi, after_attention + own)
    if running_s == 0.0:
        return after
    age = 0.0 if now is None else max(0.0, now - node.reported_at)
    elapsed = node.running_step_elapsed_s
    ran = (0.5 * running_s if elapsed is None else elapsed) + age
    return running_s + after - (ran if ran < shown_s else shown_s)


def _queue_facts(models: LatencyModels, node: PrefillNodeState) -> tuple[LatencyModels, int, float, float, float]:
    """What ``packed_prefill_s`` reads of a prefill node's state alone, kept on the state
    (``PrefillNodeState.derived``): a decision weighs every prefill node for every request, and a
    state lives from one heartbeat or dispatch to the next. The queue's tokens after the step
    running at the heartbeat and their attention work; that step's time, and the reported queue's."""
    chi, queued = node.chunk_tokens, node.outstanding_tokens
    reported = queued - node.overlay_tokens
    running = min(reported, chi)  # the step the node was running at its heartbeat
    if running <= 0:
        return models, queued, node.attention_tokens, 0.0, 0.0
    running_attention = node.attention_tokens * running / queued  # the queue's, by its share of the tokens
    running_s = models.prefill_steps_s(running, chi, running_attention)
    shown_s = running_s + models.prefill_steps_s(
        reported - running, chi, node.attention_tokens * (reported - running) / queued
    )
    return models, queued - running, node.attention_tokens - running_attention, running_s, shown_s


def keep_prefill_s(
    models: LatencyModels,
    config: DeciderConfig,
    node: PrefillNodeState,
    prompt_tokens: int,
    cached_tokens: int = 0,
    now: float | None = None,
) -> float:
    """The keep path's prefill end on ``node``: ``packed_prefill_s`` for the full keep estimate,
    Eq. 1 (``prefill_ttft_s``) for ``keep_estimate="eq1"``."""
    if config.keep_estimate == "eq1":
        return prefill_ttft_s(models, node, prompt_tokens, cached_tokens)
    return packed_prefill_s(models, node, prompt_tokens, cached_tokens, now)


def prefill_ttft_s(models: LatencyModels, node: PrefillNodeState, prompt_tokens: int, cached_tokens: int = 0) -> float:
    """Eq. 1: queue wait + prefill execution on one prefill node (of the uncached tokens)."""
    return prefill_queue_wait_s(models, node) + prefill_exec_s(models, prompt_tokens, node.chunk_tokens, cached_tokens)
