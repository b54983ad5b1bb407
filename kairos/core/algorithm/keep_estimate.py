"""The keep path's TTFT: Eq. 1 and what the paper leaves out, the hand-off from the prefill's end
to the first token on the keep path's decode node (link queue, KV transfer, admission wait, the
first decode step)."""

from __future__ import annotations

from kairos.core.algorithm.config import DeciderConfig
from kairos.core.algorithm.decode_load import committed_batch
from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState


def keep_handoff_s(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    prefill_s: float,
    cached_tokens: int = 0,
    now: float | None = None,
) -> float:
    """From the prefill's end (``prefill_s`` from ``now``) to the first token on decode node
    ``node``: W_link + T_xfer + W_adm + T_join.

    - T_xfer: the prompt's KV the node lacks over its inbound link, the profile's transfer model
      (latency + tokens x bytes per token / bandwidth: the simulator's and the emulated node's):
      the ``cached_tokens`` of the prompt's prefix it holds are not pulled (vLLM's NixlConnector
      takes the decode side's local hit from its own cache and reads only the rest).
    - W_link: the link is FIFO, one transfer at a time. Ahead of this one: the pulls the node
      reports (pending_kv_pull_tokens, prefilled keeps whose KV it has yet to take), less what
      the link has run of them since the heartbeat (with ``now``: the first one, running then,
      for as long as the node says, ``running_kv_pull_elapsed_s``, or half done on average, and
      the heartbeat's age); then, with ``now``, the keeps this dispatcher sent
      the node whose prefill still runs (``incoming_link``), each joining the link at its
      predicted prefill end, those that end before this prefill does. The wait is what is left of
      that queue when this prefill ends. Without ``now`` (the estimate as it was before the
      arrivals were kept) the pulls alone, the first one whole. (Leaving the incoming keeps out
      left the link's wait at a third of the truth on Bursty 2P2D with exact inputs:
      bench/sim/prediction_error.py.)
    - W_adm: a transfer starts only when the node's KV can hold the prompt. Free KV = capacity -
      K - what the backlog, the incoming keeps and the pulls ahead will take. When short by D
      tokens, the node frees them as its decodes finish: k / (M x T0) tokens per second with k
      tokens held by b decodes whose remaining outputs are memoryless with mean M
      (``mean_output_tokens``), so D x M x T0 / k from now, less the time already to pass
      before the transfer could start.
    - T_join: the request joins the node's next step; its first token is that step's, T0(b+1,
      k+prompt), after the step running then (``join_wait_s``; none on an idle node).

    b and k are the node's decodes and KV once the backlog, the incoming keeps and the pulls
    ahead have joined."""
    wait, b, k, t0 = _landing(models, config, node, prompt_tokens, prompt_tokens, prefill_s, cached_tokens, now)
    join = models.decode_step_s(b + 1, k + prompt_tokens) + (
        join_wait_s(models, node, t0, prefill_s + wait, now) if b > 0 else 0.0
    )
    return wait + join


def kv_landing_s(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    pulled_tokens: int,
    prefill_s: float,
    cached_tokens: int = 0,
    now: float | None = None,
) -> float:
    """From the prefill's end (``prefill_s`` from ``now``) until the KV of the prompt's first
    ``pulled_tokens`` has landed on decode node ``node``: W_link + T_xfer + W_adm of
    ``keep_handoff_s``, the transfer of those tokens less the ``cached_tokens`` the node holds,
    the admission for the whole prompt (a split's node prefills the rest into its own KV)."""
    return _landing(models, config, node, prompt_tokens, pulled_tokens, prefill_s, cached_tokens, now)[0]


def _landing(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    pulled_tokens: int,
    prefill_s: float,
    cached_tokens: int,
    now: float | None,
) -> tuple[float, int, int, float]:
    """W_link + T_xfer + W_adm (``keep_handoff_s``), and the node's decodes, KV tokens and T0
    once the backlog, the incoming keeps and the pulls ahead have joined."""
    t = models.transfer
    per_token = t.bytes_per_token / t.bandwidth_bytes_per_s
    pulls = node.pending_kv_pull_tokens
    clear = len(pulls) * t.latency_s + sum(pulls) * per_token  # from now, when the link is free
    if now is not None:
        if pulls:  # the link has run: its first transfer, as long as the node says (else half of it), and since
            ran = node.running_kv_pull_elapsed_s
            if ran is None:
                ran = 0.5 * (t.latency_s + pulls[0] * per_token)
            clear -= min(ran + max(0.0, now - node.reported_at), clear)
        if node.incoming_link is not None:  # in closed form: O(log n) however many are on their way
            clear = node.incoming_link.clear_s(now + clear, now + prefill_s) - now
    link_wait = max(0.0, clear - prefill_s)
    transfer = t.latency_s + max(0, pulled_tokens - cached_tokens) * per_token
    b, k = committed_batch(node)
    t0 = models.decode_step_s(b, k)
    admission = 0.0
    deficit = prompt_tokens - (node.kv_capacity_tokens - k)
    if deficit > 0 and k > 0:
        admission = max(0.0, deficit * config.mean_output_tokens * t0 / k - prefill_s - link_wait)
    return link_wait + transfer + admission, b, k, t0


def join_wait_s(
    models: LatencyModels, node: DecodeNodeState, step_s: float, lands_s: float, now: float | None
) -> float:
    """From the KV's landing on decode node ``node`` (``lands_s`` from ``now``) to the end of the
    step the node runs then, which the request joins after. The node's decodes run step after step:
    where it said how long its step in flight had run at its heartbeat (``running_step_elapsed_s``)
    and runs no deflected prefill, their train is projected to then at that step's time, T0 of its
    batch as reported. With truth = model that is exact while the batch holds; where it changes
    (a decode ends or joins, a chunk runs) or steps vary, the phase drifts, as unknown as it is
    without the field. Else half of ``step_s`` (T0 of the batch then) on average."""
    elapsed = node.running_step_elapsed_s
    if elapsed is None or now is None or node.prefill_backlog_tokens or not node.decode_tokens:
        return 0.5 * step_s
    step = models.decode_step_s(node.decode_tokens, node.kv_tokens)
    if step <= 0.0:
        return 0.5 * step_s
    return step - (elapsed + max(0.0, now - node.reported_at) + lands_s) % step


def keep_ttft_s(
    models: LatencyModels,
    config: DeciderConfig,
    prefill_s: float,
    node: DecodeNodeState,
    prompt_tokens: int,
    cached_tokens: int = 0,
    now: float | None = None,
) -> float:
    """The keep path's TTFT through a prefill node whose prefill ends ``prefill_s`` from ``now``
    (``keep_prefill_s``) and decode node ``node``, which caches ``cached_tokens`` of the prompt:
    that + ``keep_handoff_s`` (``keep_estimate="full"``), or Eq. 1 alone ("eq1")."""
    if config.keep_estimate == "eq1":
        return prefill_s
    return prefill_s + keep_handoff_s(models, config, node, prompt_tokens, prefill_s, cached_tokens, now)
