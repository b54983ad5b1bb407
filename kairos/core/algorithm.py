"""Algorithm 1 of the Kairos paper: the per-request deflection decision (Eqs. 1-7).

Pure and clock-free: ``decide`` reads a :class:`ClusterView` and the time ``now`` it is given,
and returns a :class:`Decision`. The ext_proc server, the simulator and the benchmarks all call
this same function.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from statistics import NormalDist

from kairos.common import defaults
from kairos.common.errors import ConfigError, InvalidRequestError, NoHealthyNodeError
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.slo import RequestSLO
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState

DEFAULT_CHUNK_CANDIDATES = defaults.CHUNK_CANDIDATES
# A step predicted at t runs up to t x (1 + _P95_SIGMAS_PER_MAE x model_error) at its 95th
# percentile when the model's relative errors are normal with that mean absolute value: z(0.95)
# sigmas, and sigma = sqrt(pi/2) x MAE. The TBT SLO is a P95, so that is the margin it needs.
_P95_SIGMAS_PER_MAE = NormalDist().inv_cdf(0.95) * math.sqrt(math.pi / 2)
KEEP_ESTIMATES = ("full", "eq1")  # DeciderConfig.keep_estimate


@dataclass(frozen=True, slots=True)
class DeciderConfig:
    """Knobs of Algorithm 1. Defaults are the paper's (§6.1)."""

    alpha: float = defaults.ALPHA  # deflect when TTFT_dec <= alpha x TTFT_pf (Eq. 7); >= 1
    beta: float = defaults.BETA  # TBT safety factor: every scheduled step <= beta x tau (Eq. 5)
    tbt_slo_s: float = defaults.TBT_SLO_S  # tau
    ttft_slo_s: float = defaults.TTFT_SLO_S  # TTFT SLO of Eq. 7
    chunk_candidates: tuple[int, ...] = DEFAULT_CHUNK_CANDIDATES  # strictly decreasing step sizes
    stale_after_s: float = defaults.STALE_AFTER_S  # a heartbeat older than this makes a node ineligible to deflect to
    # Deflected prefills a decode node may hold in flight (reported backlog + dispatches since
    # the heartbeat) for it to take another; None: no limit, a new deflection is scheduled behind
    # the node's backlog. 1 is the paper's §5.3 rule.
    max_pending_deflections: int | None = defaults.MAX_PENDING_DEFLECTIONS
    # Send step_budget_s with each schedule so the decode node shrinks a chunk whose step would
    # overrun it with the batch it actually has then (decodes join between heartbeats).
    node_step_guard: bool = True
    # Deflect to no node whose decode-only step is already over decode_overload_s; False (the
    # paper's Algorithm 1) only to measure what the rule changes.
    decode_overload_guard: bool = True
    # With the overload guard, while the keep path meets the TTFT SLO: deflect to no node whose
    # decode-only step with the request joined (decode_load_after_s) is over this share of
    # decode_overload_s, uncalibrated (decode pressure: its decodes are the cluster's bottleneck,
    # and the chunks would take their time to save a TTFT that meets its SLO anyway). None: no
    # such rule.
    decode_pressure_share: float | None = defaults.DECODE_PRESSURE_SHARE
    # No deflection while the keep path's TTFT estimate is under this share of the TTFT SLO
    # (deflection_gate_open): it meets the SLO with room. None: Eq. 7 decides alone (the paper).
    deflect_gate_share: float | None = defaults.DEFLECT_GATE_SHARE
    # The step model's mean absolute relative error against the node's real step times (a
    # profile's held-out MAPE). Schedules planned to the budget's edge with an erring model
    # overrun tau on about half their steps, where P/D's shorter decode-only steps rarely do:
    # both step lines shrink by the error's P95 (see step_budget_s). 0 trusts the model.
    model_error: float = 0.0
    # Plan each decode node's steps to its own line: both step lines divided by the step
    # calibration the node reports (DecodeNodeState.step_calibration, the 99th percentile of its
    # actual / predicted step times), so its steps with deflected chunks stay under tau 99% of the
    # time however far its model is off. It composes with beta and model_error (each an extra,
    # optional margin). A node that reports none counts 1.0: the lines above, unchanged. False
    # ignores the reports (to measure what calibration changes).
    calibrate: bool = True
    # The keep path's TTFT estimate that Eq. 7 compares with: "full" (keep_ttft_s: Eq. 1 + the
    # KV transfer behind the decode node's link queue + its admission wait + its first decode
    # step, after the half step the node is running then) or "eq1" (the paper's Eq. 1 alone, for
    # comparison). The deflection's estimate is built alike: with "full" it starts at the decode
    # node's next step (backlog_end), with "eq1" at once (the paper's Eq. 6).
    keep_estimate: str = defaults.KEEP_ESTIMATE
    # A running decode's mean remaining output tokens (memoryless): how fast a decode node frees
    # KV, for the keep path's admission wait when the node's KV cannot take the prompt now.
    mean_output_tokens: float = defaults.MEAN_OUTPUT_TOKENS
    # Plan a deflection beside the decodes whose KV the node is pulling (pending_kv_pull_tokens:
    # prefilled keeps, each joins its batch once pulled, within the link's time): the node's step
    # guard shrinks each chunk to the batch it has then, so a plan on the heartbeat's B alone
    # promised a first token they delayed. False plans on B alone (the paper).
    plan_with_pulls: bool = True

    def __post_init__(self) -> None:
        # Written as "not (valid)" so that NaN, which fails every comparison, is rejected too.
        if not (1.0 <= self.alpha < math.inf):
            raise ConfigError(f"alpha must be a finite number >= 1, got {self.alpha}")
        if not (0.0 < self.beta <= 2.0):
            raise ConfigError(f"beta must be in (0, 2], got {self.beta}")
        if not (0 < self.tbt_slo_s < math.inf and 0 < self.ttft_slo_s < math.inf):
            raise ConfigError(f"tbt_slo_s={self.tbt_slo_s} and ttft_slo_s={self.ttft_slo_s} must be finite and > 0")
        cands = self.chunk_candidates
        if not cands or any(x < 1 for x in cands) or any(a <= b for a, b in itertools.pairwise(cands)):
            raise ConfigError(f"chunk_candidates must be positive and strictly decreasing, got {list(cands)}")
        if not (self.stale_after_s > 0):
            raise ConfigError(f"stale_after_s must be > 0, got {self.stale_after_s}")
        if self.max_pending_deflections is not None and self.max_pending_deflections < 1:
            raise ConfigError(f"max_pending_deflections must be >= 1 or None, got {self.max_pending_deflections}")
        share = self.decode_pressure_share
        if share is not None and not (0.0 < share <= 1.0):
            raise ConfigError(f"decode_pressure_share must be in (0, 1] or None, got {share}")
        gate = self.deflect_gate_share
        if gate is not None and not (0.0 < gate <= 1.0):
            raise ConfigError(f"deflect_gate_share must be in (0, 1] or None, got {gate}")
        if not (0.0 <= self.model_error < 1.0):
            raise ConfigError(f"model_error must be in [0, 1), got {self.model_error}")
        if self.keep_estimate not in KEEP_ESTIMATES:
            raise ConfigError(f"keep_estimate must be one of {list(KEEP_ESTIMATES)}, got {self.keep_estimate!r}")
        if not (1.0 <= self.mean_output_tokens < math.inf):
            raise ConfigError(f"mean_output_tokens must be a finite number >= 1, got {self.mean_output_tokens}")

    @property
    def error_margin(self) -> float:
        """1 + z(0.95) x sigma of the model's error: predicted steps are held this much under a line."""
        return 1.0 + _P95_SIGMAS_PER_MAE * self.model_error

    @property
    def step_budget_s(self) -> float:
        """beta x tau / error_margin: the longest predicted step a schedule may contain."""
        return self.beta * self.tbt_slo_s / self.error_margin

    @property
    def decode_overload_s(self) -> float:
        """min(tau, beta x tau) / error_margin: a decode node whose predicted decode-only step is
        already longer takes no deflection. Over beta x tau no chunk fits and the node's own guard
        would hold the prefill until its batch shrinks; over tau (beta > 1) its decodes already
        miss the SLO on every step, and prefill work there only lengthens those steps and the
        batch's drain."""
        return min(self.tbt_slo_s / self.error_margin, self.step_budget_s)


def with_request_slo(config: DeciderConfig, slo: RequestSLO | None) -> DeciderConfig:
    """``config`` with the request's own TTFT and TPOT SLOs in place of the cluster's (``config``
    itself when it has them already, or for None): every rule of a decision then reads the
    request's, Eq. 7's bound and Eq. 5's tau (tightened on each node by ``node_tau_s``)."""
    if slo is None or (slo.ttft_s == config.ttft_slo_s and slo.tpot_s == config.tbt_slo_s):
        return config
    return _with_slos(config, slo.ttft_s, slo.tpot_s)


@functools.lru_cache(maxsize=256)
def _with_slos(config: DeciderConfig, ttft_s: float, tpot_s: float) -> DeciderConfig:
    # One config per (config, SLO pair): a class's requests share it, and a node's derived facts
    # (``_facts``), kept for the config they were built with, stay valid across them.
    return dataclasses.replace(config, ttft_slo_s=ttft_s, tbt_slo_s=tpot_s)


def _tau_share(config: DeciderConfig, node: DecodeNodeState) -> float:
    """Eq. 5's tau on ``node`` as a share of ``config.tbt_slo_s`` (the request's TPOT): the node's
    tightest TPOT among its requests in flight over the request's, when tighter; else 1."""
    tpot = node.tpot_slo_s
    return 1.0 if tpot is None or tpot >= config.tbt_slo_s else tpot / config.tbt_slo_s


def node_step_budget_s(config: DeciderConfig, node: DecodeNodeState) -> float:
    """Eq. 5's line on ``node``: beta x tau / error margin / the node's step calibration (with
    ``config.calibrate``), the longest predicted step a schedule there may contain, where tau is
    the tightest of the request's TPOT (``config.tbt_slo_s``) and the node's requests' in flight
    (``DecodeNodeState.tpot_slo_s``): a looser request never loosens the node's steps. A node of
    no tighter TPOT and a calibration of 1.0 give ``config.step_budget_s`` to the bit."""
    budget = config.step_budget_s
    if config.calibrate:
        budget /= node.step_calibration
    share = _tau_share(config, node)
    return budget if share == 1.0 else budget * share


def keep_step_budget_s(config: DeciderConfig, node: DecodeNodeState) -> float | None:
    """The step budget a keep carries for its decode node ``node`` (None without the node step
    guard): should the prefill node fail it, the node's sidecar prefills it there, and the
    node's guard holds those steps to this budget, as a deflection's."""
    return node_step_budget_s(config, node) if config.node_step_guard else None


def node_overload_s(config: DeciderConfig, node: DecodeNodeState) -> float:
    """``config.decode_overload_s`` on ``node``, at the node's tau (``node_step_budget_s``) and
    divided by its step calibration likewise."""
    line = config.decode_overload_s * _tau_share(config, node)
    return line / node.step_calibration if config.calibrate else line


# ---------------------------------------------------------------------------------------------
# Prefill-node TTFT estimator (§4.2)
# ---------------------------------------------------------------------------------------------
def prefill_queue_wait_s(models: LatencyModels, node: PrefillNodeState) -> float:
    """Eq. 2: (sum l_i / chi_p) steps, each costed over half of its own prompt cached, on
    average: the token-weighted mean of l_i / 2, sum l_i^2 / (2 sum l_i).

    The paper costs every step over half the whole queue (sum l_i / 2), as if the queue were one
    prompt; a chunk attends to its own prompt's prefix only (the multi-chunk steps of
    ``predicted_step_s`` are costed the same way), so that cost grew with the square of the
    queue. Under sustained load it held keep-path requests incoming on their decode node long
    after they had arrived, until the overload line and the promised KV barred every deflection,
    and the prefill queue grew further (Bursty 8 RPS 2P2D: 710 deflections, attainment 21.6%;
    keep-path MAPE 8.5 for P/D, bench/sim_keep_estimate.py). One queued prompt: the paper's, to
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
    end off by 3.5% of its TTFT that way, 2.2% this way: bench/sim_prediction_error.py).

    Less what the node has run since its heartbeat (``reported_at``): the step it was running
    then, half done on average, and the heartbeat's age since, as far as the queue the heartbeat
    showed lasts (the view's overlay, ``overlay_tokens``, is work sent since; a node idle at its
    heartbeat starts it at once). With ``now`` None the heartbeat is taken as current."""
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
    return running_s + after - min(0.5 * running_s + age, shown_s)


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


# ---------------------------------------------------------------------------------------------
# The keep path's TTFT: Eq. 1 and what the paper leaves out
# ---------------------------------------------------------------------------------------------
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
      half done on average, and the heartbeat's age); then, with ``now``, the keeps this dispatcher sent
      the node whose prefill still runs (``incoming_link``), each joining the link at its
      predicted prefill end, those that end before this prefill does. The wait is what is left of
      that queue when this prefill ends. Without ``now`` (the estimate as it was before the
      arrivals were kept) the pulls alone, the first one whole. (Leaving the incoming keeps out
      left the link's wait at a third of the truth on Bursty 2P2D with exact inputs:
      bench/sim_prediction_error.py.)
    - W_adm: a transfer starts only when the node's KV can hold the prompt. Free KV = capacity -
      K - what the backlog, the incoming keeps and the pulls ahead will take. When short by D
      tokens, the node frees them as its decodes finish: k / (M x T0) tokens per second with k
      tokens held by b decodes whose remaining outputs are memoryless with mean M
      (``mean_output_tokens``), so D x M x T0 / k from now, less the time already to pass
      before the transfer could start.
    - T_join: the request joins the node's next step; its first token is that step's, T0(b+1,
      k+prompt), after the step running then (half a step on average; none on an idle node).

    b and k are the node's decodes and KV once the backlog, the incoming keeps and the pulls
    ahead have joined."""
    t = models.transfer
    per_token = t.bytes_per_token / t.bandwidth_bytes_per_s
    pulls = node.pending_kv_pull_tokens
    clear = len(pulls) * t.latency_s + sum(pulls) * per_token  # from now, when the link is free
    if now is not None:
        if pulls:  # the link has run since the heartbeat: its first transfer then, half done, and since
            clear -= min(0.5 * (t.latency_s + pulls[0] * per_token) + max(0.0, now - node.reported_at), clear)
        if node.incoming_link is not None:  # in closed form: O(log n) however many are on their way
            clear = node.incoming_link.clear_s(now + clear, now + prefill_s) - now
    link_wait = max(0.0, clear - prefill_s)
    transfer = t.latency_s + (prompt_tokens - cached_tokens) * per_token
    b, k = committed_batch(node)
    t0 = models.decode_step_s(b, k)
    admission = 0.0
    deficit = prompt_tokens - (node.kv_capacity_tokens - k)
    if deficit > 0 and k > 0:
        admission = max(0.0, deficit * config.mean_output_tokens * t0 / k - prefill_s - link_wait)
    join = models.decode_step_s(b + 1, k + prompt_tokens) + (0.5 * t0 if b > 0 else 0.0)
    return link_wait + transfer + admission + join


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


# ---------------------------------------------------------------------------------------------
# Decode-node feasibility checker (§4.3)
# ---------------------------------------------------------------------------------------------
# A run of equal steps: (prefill tokens per step, steps, first step's time, time added per step).
Run = tuple[int, int, float, float]


def expand_runs(runs: list[Run] | tuple[Run, ...]) -> tuple[list[int], list[float]]:
    """Per-step prefill tokens and predicted times of a schedule kept as runs."""
    sizes: list[int] = []
    times: list[float] = []
    for p, n, first, inc in runs:
        sizes.extend([p] * n)
        times.extend([first + j * inc for j in range(n)])
    return sizes, times


@dataclass(frozen=True, slots=True)
class _Plan:
    decode_tokens: int  # B the request's own steps run beside (after any backlog finished)
    runs: tuple[Run, ...]  # the request's schedule
    ttft_s: float  # includes the wait behind the node's backlog, if any
    step_budget_s: float  # the node's step budget the schedule was planned to (node_step_budget_s)


_INFEASIBLE = "infeasible"  # no TBT-safe chunk exists at some step
_TOO_SLOW = "too_slow"  # abandoned: already slower than the bound that could make it win


# Eq. 4 on one (B, K), for the schedule search: (a0, a_c, b0, b1, k_coef, knee) as in
# mixed_step_coefficients, then per candidate its full chunk's prefill tokens, base and slope.
StepTable = tuple[float, float, float, float, float, float, list[int], list[float], list[float]]


def _step_table(models: LatencyModels, decode_tokens: int, kv_tokens: int, candidates: tuple[int, ...]) -> StepTable:
    """Eq. 4 on one (B, K): its coefficients (``mixed_step_coefficients``), and per candidate
    chi the prefill tokens of a full chunk and its step time ``base + slope * cached``."""
    a0, a_c, b0, b1, k_coef, knee = models.mixed_step_coefficients(decode_tokens, kv_tokens)
    full = [x - decode_tokens for x in candidates]
    base = [a0 + p * b0 + (k_coef * (x - knee) if x > knee else 0.0) for x, p in zip(candidates, full, strict=True)]
    slope = [a_c + p * b1 for p in full]
    return a0, a_c, b0, b1, k_coef, knee, full, base, slope


def _safe_steps(first: float, inc: float, step_budget_s: float) -> int:
    """How many steps of a run (``first``, growing by ``inc`` > 0) stay within the budget."""
    n = int((step_budget_s - first) / inc) + 1
    while n > 1 and first + (n - 1) * inc > step_budget_s:  # float rounding
        n -= 1
    return n


def greedy_schedule(
    models: LatencyModels,
    prompt_tokens: int,
    decode_tokens: int,
    kv_tokens: int,
    candidates: tuple[int, ...],
    step_budget_s: float,
    give_up_after_s: float = math.inf,
    start_s: float = 0.0,
    cached_tokens: int = 0,
) -> tuple[list[Run], float] | str:
    """Eq. 5 and 6: at each step take the largest candidate chi whose step stays within
    ``step_budget_s``; a step of chi tokens carries chi - B prefill tokens (§3.2), and the KV
    the request has built so far adds to the node's K. With a prefix of ``cached_tokens`` in the
    node's cache, the steps cover the rest, each over that prefix too.

    The final step carries only the tokens left, and is costed with them. Returns the schedule
    as runs of equal steps and the finishing time (``start_s`` + the step times), or
    ``_INFEASIBLE`` / ``_TOO_SLOW``.

    This runs for every decode node on every request, so Eq. 4 is unrolled: with B and K
    fixed, a step of chi tokens over c cached ones costs ``base[chi] + slope[chi] * c``, and
    the greedy keeps one chi for as many steps as that stays within budget, a count and a time
    sum that are closed-form. The result is the step-by-step greedy's, in O(candidates).
    """
    table = _step_table(models, decode_tokens, kv_tokens, candidates)
    return _greedy_steps(
        table,
        decode_tokens,
        models.mixed_monotone,
        step_budget_s,
        give_up_after_s,
        prompt_tokens - cached_tokens,
        cached_tokens,
        0,
        start_s,
        [],
    )


def _greedy_steps(
    table: StepTable,
    b: int,
    monotone: bool,
    step_budget_s: float,
    give_up_after_s: float,
    remaining: int,
    cached: int,
    idx: int,
    t: float,
    runs: list[Run],
) -> tuple[list[Run], float] | str:
    """``greedy_schedule``'s loop, from any point of a schedule: ``remaining`` tokens left over
    ``cached`` ones, ``idx`` the candidate reached (those above it were unsafe as full chunks;
    they only get costlier as c grows), ``t`` the time so far, ``runs`` the runs so far (extended)."""
    a0, a_c, b0, b1, k_coef, knee, full, base, slope = table
    n_cand = len(full)
    largest = full[0]
    while remaining > 0:
        if not monotone:
            idx = 0
        # Finish in one step if the largest candidate can hold the rest and that step is safe.
        if remaining <= largest:
            x = b + remaining
            s = a0 + a_c * cached + remaining * (b0 + b1 * cached) + (k_coef * (x - knee) if x > knee else 0.0)
            if s <= step_budget_s:
                t += s
                if t > give_up_after_s:
                    return _TOO_SLOW
                runs.append((remaining, 1, s, 0.0))
                return runs, t
        while idx < n_cand:
            f = full[idx]
            if f <= 0:  # this and every smaller candidate carry no prefill token
                idx = n_cand
                break
            if f < remaining and base[idx] + slope[idx] * cached <= step_budget_s:
                break
            idx += 1
        if idx >= n_cand:
            return _INFEASIBLE
        p = full[idx]
        first = base[idx] + slope[idx] * cached
        inc = slope[idx] * p
        # Steps of p tokens: while each stays within budget, while a full chunk is still less
        # than what remains, and (once the rest fits the largest candidate) one at a time so the
        # finishing check above runs.
        if not monotone:
            n = 1
        elif remaining <= largest:
            # In the tail, walk the run just until the rest could finish in one safe step.
            n, c_j, r_j = 1, cached + p, remaining - p
            while r_j > p and first + n * inc <= step_budget_s:
                x = b + r_j
                fin = a0 + a_c * c_j + r_j * (b0 + b1 * c_j) + (k_coef * (x - knee) if x > knee else 0.0)
                if fin <= step_budget_s:
                    break
                n, c_j, r_j = n + 1, c_j + p, r_j - p
        else:
            n = (remaining - 1) // p
            n_tail = (remaining - largest + p - 1) // p
            if n_tail < n:
                n = n_tail
            if inc > 0:
                n_safe = _safe_steps(first, inc, step_budget_s)
                if n_safe < n:
                    n = n_safe
            if n < 1:
                n = 1
        t += n * first + inc * n * (n - 1) / 2
        if t > give_up_after_s:
            return _TOO_SLOW
        runs.append((p, n, first, inc))
        cached += p * n
        remaining -= p * n
    return runs, t


def planning_batch(config: DeciderConfig, node: DecodeNodeState) -> tuple[int, int]:
    """The decodes and KV tokens a deflection on ``node`` is planned beside, before its backlog:
    the heartbeat's, with the KV pulls it reports joined (``DeciderConfig.plan_with_pulls``)."""
    pulls = node.pending_kv_pull_tokens
    if config.plan_with_pulls and pulls:
        return node.decode_tokens + len(pulls), node.kv_tokens + sum(pulls)
    return node.decode_tokens, node.kv_tokens


def _backlog_schedule(
    models: LatencyModels,
    node: DecodeNodeState,
    i: int,
    remaining: int,
    b: int,
    k: int,
    candidates: tuple[int, ...],
    step_budget_s: float,
    give_up_after_s: float,
    start_s: float,
) -> tuple[list[Run], float] | str:
    """The schedule of the node's backlog entry ``i`` (``remaining`` tokens left), run first:
    over its computed prefix, which its chunks attend to. K holds that prefix already, and the
    greedy adds a request's cached tokens to K, so it plans on K without it."""
    computed = node.backlog_computed(i)
    return greedy_schedule(
        models,
        computed + remaining,
        b,
        max(0, k - computed),
        candidates,
        step_budget_s,
        give_up_after_s,
        start_s,
        computed,
    )


def backlog_end(
    models: LatencyModels, config: DeciderConfig, node: DecodeNodeState, give_up_after_s: float = math.inf
) -> tuple[int, int, float | str]:
    """Where a new request's own steps start on ``node``: the decodes and KV tokens beside them
    (the planning batch, with the node's backlog decoding by then), and when, from now; or, for
    the time, why the backlog has no schedule (``_INFEASIBLE``, or ``_TOO_SLOW`` past
    ``give_up_after_s``).

    The engine takes a request in at a step boundary: the node's running step ends half a step
    from now on average, as the keep path's full estimate counts at its join (``keep_handoff_s``;
    with ``keep_estimate="eq1"``, whose Eq. 1 has no join, both start at once, as in the paper).
    Without a backlog, the running step is the node's decodes' (none on an idle node: it starts
    at once); with one, it is the backlog head's chunk, which its schedule counts whole, so the
    backlog ends half of that first step earlier. Then each backlog prefill runs in turn (only
    with the pending-deflection limit lifted), over its computed prefix."""
    b, k = planning_batch(config, node)
    backlog = node.prefill_backlog_tokens
    half = 0.0 if config.keep_estimate == "eq1" else 0.5
    if not backlog:
        return b, k, half * models.decode_step_s(node.decode_tokens, node.kv_tokens) if node.decode_tokens else 0.0
    cands, budget = config.chunk_candidates, node_step_budget_s(config, node)
    t: float | str = 0.0
    for i, tokens in enumerate(backlog):
        if not isinstance(t, str):
            done = _backlog_schedule(
                models, node, i, tokens, b, k, cands, budget, math.inf if i == 0 else give_up_after_s, t
            )
            if isinstance(done, str):
                t = done
            else:
                t = done[1] - (half * done[0][0][2] if i == 0 else 0.0)
                if t > give_up_after_s:
                    t = _TOO_SLOW
        b, k = b + 1, k + tokens  # the backlog request decodes on the node from then on
    return b, k, t


def plan_on_decode_node(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up_after_s: float,
    cached_tokens: int = 0,
) -> _Plan | str:
    """Schedule the request on one decode node from its next step (``backlog_end``), behind any
    deflected prefills already there, over the prompt's tokens the node does not have cached."""
    b, k, t = backlog_end(models, config, node, give_up_after_s)
    if isinstance(t, str):
        return t
    cands, budget = config.chunk_candidates, node_step_budget_s(config, node)
    done = greedy_schedule(models, prompt_tokens, b, k, cands, budget, give_up_after_s, t, cached_tokens)
    if isinstance(done, str):
        return done
    return _Plan(decode_tokens=b, runs=tuple(done[0]), ttft_s=done[1], step_budget_s=budget)


# ---------------------------------------------------------------------------------------------
# A lower bound on a node's deflection TTFT, from what its state alone determines
# ---------------------------------------------------------------------------------------------
# Relative slack on every comparison of a bound with a computed TTFT: the bound and the
# schedule's time are sums of the same non-negative terms in different orders, whose rounding
# differs by ~1e-14 of their size.
_BOUND_SLACK = 1e-9

# Fewer eligible decode nodes than this are searched in id order: the bound could spare a
# schedule search or two, and costs a greedy path for every node state it has not seen.
BOUNDED_SEARCH_MIN_NODES = 4

# A run of the greedy on a node while more than its largest chunk remains: (cached tokens at its
# start, prefill tokens per step, steps or None when unbounded, first step's time, time added per
# step, time at its start, candidate index).
PathRun = tuple[int, int, int | None, float, float, float, int]


def _greedy_path(table: StepTable, step_budget_s: float, start_s: float) -> Generator[PathRun, None, float]:
    """The greedy's runs (``_greedy_steps``') on one (B, K) while more than the largest chunk
    remains, one at a time, returning the time at their end. There every candidate is smaller
    than what remains, so the choice at each step depends on the cached tokens only, never on
    the prompt: every prompt's schedule takes exactly these steps, with the same floats (the
    same tests and sums from the same ``start_s``), until its last ``largest`` tokens. Ends where
    no candidate is safe any more (there the schedule of a longer prompt is infeasible). Needs a
    monotone profile (``mixed_monotone``: the candidate index only grows). A generator: a
    decision reads the path only as far as its prompt's tail (``_NodeFacts.extend``)."""
    full, base, slope = table[6:]
    cached, t, idx = 0, start_s, 0
    while True:
        while idx < len(full) and full[idx] > 0 and base[idx] + slope[idx] * cached > step_budget_s:
            idx += 1
        if idx == len(full) or full[idx] <= 0:
            return t
        p = full[idx]
        first = base[idx] + slope[idx] * cached
        inc = slope[idx] * p
        n = _safe_steps(first, inc, step_budget_s) if inc > 0 else None
        yield cached, p, n, first, inc, t, idx
        if n is None:
            return t
        t += n * first + inc * n * (n - 1) / 2
        cached += p * n


class _NodeFacts:
    """What a decision derives from one decode node's state alone, for one (models, config):
    kept on the state (``DecodeNodeState.derived``), so a heartbeat or a dispatch, which
    replaces the state, is what recomputes it, not every decision."""

    __slots__ = (
        "b",
        "bound_step_s",
        "budget_s",
        "config",
        "end_s",
        "ends",
        "load_s",
        "models",
        "overload_s",
        "runs",
        "table",
        "unread",
        "wait_s",
    )
    wait_s: float  # the backlog's schedules, run first (inf: one of them is infeasible)
    b: int  # decodes beside the request's own steps (the backlog's requests decode by then)
    table: StepTable  # Eq. 4 for the request's own steps
    end_s: float  # time at the end of the path (once ``unread`` is None: the whole path is read)
    bound_step_s: float  # the longest step ttft_lower_bound_s lets a schedule's last step take

    def __init__(self, models: LatencyModels, config: DeciderConfig, node: DecodeNodeState) -> None:
        self.models, self.config = models, config
        self.load_s = decode_load_s(models, node)
        self.budget_s = node_step_budget_s(config, node)  # Eq. 5's line on this node
        self.overload_s = node_overload_s(config, node)
        self.runs: list[PathRun] | None = None  # the rest is built on the first bound asked for
        self.ends: list[float] = []  # cached tokens at each run's end (inf: unbounded)
        self.unread: Generator[PathRun, None, float] | None = None  # the path's runs not read yet

    def build_path(self, node: DecodeNodeState) -> None:
        """The time to run the node's backlog, then, for the request's own steps beside it:
        Eq. 4's coefficients, the largest chunk's prefill tokens and the start of the greedy's
        path (its runs are read as far as a prompt needs them: ``extend``)."""
        models, config, budget = self.models, self.config, self.budget_s
        b, k, end = backlog_end(models, config, node)
        t = math.inf if isinstance(end, str) else end
        self.wait_s, self.b = t, b
        self.table = _step_table(models, b, k, config.chunk_candidates)
        self.unread = _greedy_path(self.table, budget, t)
        self.bound_step_s = budget * (1 + _BOUND_SLACK)
        self.runs = []  # last: a set ``runs`` says the rest is there

    def extend(self, target: int) -> None:
        """Read the path's runs until one ends at ``target`` cached tokens or later (at least
        one run), or the path ends (then ``end_s`` is its end)."""
        runs, ends, rest = self.runs, self.ends, self.unread
        assert runs is not None
        while rest is not None and (not ends or ends[-1] < target):
            try:
                run = next(rest)
            except StopIteration as end:
                self.end_s, self.unread = end.value, None
                return
            c0, p, n = run[:3]
            runs.append(run)
            ends.append(math.inf if n is None else c0 + p * n)


def _facts(models: LatencyModels, config: DeciderConfig, node: DecodeNodeState) -> _NodeFacts:
    facts = node.derived
    if (
        type(facts) is not _NodeFacts
        or facts.models is not models
        or not (facts.config is config or facts.config == config)
    ):
        facts = _NodeFacts(models, config, node)
        object.__setattr__(node, "derived", facts)
    return facts


def _tail_start(facts: _NodeFacts, node: DecodeNodeState, prompt_tokens: int) -> tuple[int, float, int, int] | None:
    """Where the greedy's schedule of this prompt leaves the node's path: (cached tokens, time
    then, the run it leaves in, steps taken of that run; the start when the prompt is no longer
    than the largest chunk), or None when the path ends first (no schedule: infeasible or too slow)."""
    runs = facts.runs
    if runs is None:
        facts.build_path(node)
        runs = facts.runs
        assert runs is not None
    full = facts.table[6]
    if full[0] <= 0:  # no chunk carries a prefill token beside B decodes
        return None
    target = prompt_tokens - full[0]
    ends = facts.ends
    if facts.unread is not None and (not ends or ends[-1] < target):
        facts.extend(target)  # the run the tail starts in, and the first one (the bound's chunk)
    if target <= 0:
        return 0, facts.wait_s, 0, 0
    r = bisect.bisect_left(facts.ends, target)  # the run in which the schedule reaches its tail
    if r == len(runs):
        return None
    c0, p, _, first, inc, t0, _ = runs[r]
    j = -((c0 - target) // p)  # the greedy's n_tail
    return c0 + j * p, t0 + (j * first + inc * j * (j - 1) / 2), r, j


def _plan_on_path(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up_after_s: float,
    cached_tokens: int = 0,
) -> _Plan | str:
    """``plan_on_decode_node``, to the bit, on a monotone profile: for a node without a backlog
    the greedy's steps along the node's path are read from it, and the greedy runs on from where
    the prompt's tail starts. (The path starts from nothing cached: a cached prefix plans directly.)"""
    if node.prefill_backlog_tokens or cached_tokens:
        return plan_on_decode_node(models, config, node, prompt_tokens, give_up_after_s, cached_tokens)
    facts = _facts(models, config, node)
    tail = _tail_start(facts, node, prompt_tokens)
    if tail is None:  # the greedy follows the whole path (read to its end), then finds no safe candidate
        return _TOO_SLOW if facts.runs and facts.end_s > give_up_after_s else _INFEASIBLE
    cached, t, r, j = tail
    runs: list[Run] = []
    idx = 0
    if j:
        if t > give_up_after_s:  # the greedy's earlier run ends are no later
            return _TOO_SLOW
        path = facts.runs
        assert path is not None  # built by _tail_start
        for _, p, n, first, inc, _, _ in path[:r]:
            assert n is not None  # only a path's last run is unbounded
            runs.append((p, n, first, inc))
        _, p, _, first, inc, _, idx = path[r]
        runs.append((p, j, first, inc))
    done = _greedy_steps(
        facts.table, facts.b, True, facts.budget_s, give_up_after_s, prompt_tokens - cached, cached, idx, t, runs
    )
    if isinstance(done, str):
        return done
    return _Plan(decode_tokens=facts.b, runs=tuple(done[0]), ttft_s=done[1], step_budget_s=facts.budget_s)


def ttft_lower_bound_s(
    models: LatencyModels, config: DeciderConfig, node: DecodeNodeState, prompt_tokens: int
) -> float:
    """A TTFT no schedule ``plan_on_decode_node`` finds on ``node`` for this prompt beats
    (``math.inf``: it finds none), valid when ``models.mixed_nonnegative``.

    The request's schedule takes the node's prompt-independent greedy path (``_greedy_path``)
    until at most ``largest`` tokens remain, at cached c*; that time is exact. Each step after
    costs at least ``a0 + a_c c* + p (b0 + b1 c*)`` for its p tokens, only the last one carries
    more than the run's chunk at c* (the greedy's candidate index only grows), and the last one
    carries no more than a TBT-safe step at c* can.
    """
    return _lower_bound(_facts(models, config, node), node, prompt_tokens)


def _lower_bound(facts: _NodeFacts, node: DecodeNodeState, prompt_tokens: int) -> float:
    """``ttft_lower_bound_s`` from the node's facts (the search has them at hand)."""
    tail = _tail_start(facts, node, prompt_tokens)
    if tail is None:
        return math.inf
    cached, t, r, _ = tail
    runs = facts.runs
    chunk = runs[r][1] if runs else 0
    a0, a_c, b0, b1 = facts.table[:4]
    rest = prompt_tokens - cached
    head = a0 + a_c * cached
    per_token = b0 + b1 * cached
    steps = 1
    if per_token > 0 and chunk > 0:
        last_max = (facts.bound_step_s - head) / per_token
        if rest > last_max:  # integers from here: the count must not round up
            steps += -((math.floor(max(0.0, last_max)) - rest) // chunk)
    return t + steps * head + rest * per_token


# ---------------------------------------------------------------------------------------------
# Node eligibility and keep-path choices
# ---------------------------------------------------------------------------------------------
def is_fresh(reported_at: float, now: float, config: DeciderConfig) -> bool:
    return now - reported_at <= config.stale_after_s


def can_take_deflection(node: DecodeNodeState, now: float, config: DeciderConfig, prompt_tokens: int) -> bool:
    """Fresh heartbeat, room for the prompt's KV, and under the pending-deflection limit."""
    if not is_fresh(node.reported_at, now, config) or node.free_kv_tokens < prompt_tokens:
        return False
    limit = config.max_pending_deflections
    return limit is None or len(node.prefill_backlog_tokens) < limit


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


def decode_pressure_refusal(
    models: LatencyModels, config: DeciderConfig, prompt_tokens: int, ttft_pf: float
) -> Callable[[DecodeNodeState], bool] | None:
    """The decode pressure rule for one request: None where it does not apply, else whether it
    refuses a deflection candidate. While the keep path's TTFT ``ttft_pf`` meets the SLO, it
    refuses a node whose decode-only step with the request joined is over
    ``decode_pressure_share`` of the overload line. The request decodes on some decode node
    either way; its chunks would lengthen the steps of a node whose own decodes already near
    tau, to save part of a TTFT that needs no saving. When the keep path misses the SLO, the
    deflection can still rescue the request, and no candidate is refused.

    The line is a share of ``config.decode_overload_s``, not of the node's calibrated one: the
    rule is about P/D's own decodes nearing tau on batch swings, and the model's error has its
    margin already, in the calibrated overload line and step budget. Divided by the calibration
    too, the error counted twice: at a 10% step error (a 99th-percentile ratio near 1.29) the line
    fell to 46 ms, under Bursty's 48 ms decode-only steps, and refused nearly every deflection
    (``bench/sim_calibration.py``). With no error (calibration 1) nothing changes. It is taken at
    the node's tau (its tightest TPOT in flight, when tighter than the request's), as the
    overload line is.

    A predicate, asked of the candidates the search reaches, rather than a filter over all of
    them: the bounded search plans a few of a thousand nodes, and a refused node skipped where
    it would be planned leaves the same winner as its absence."""
    share = config.decode_pressure_share
    if share is None or not config.decode_overload_guard or ttft_pf > config.ttft_slo_s:
        return None
    line_s = share * config.decode_overload_s

    def refuses(node: DecodeNodeState) -> bool:
        return decode_load_after_s(models, node, prompt_tokens) > line_s * _tau_share(config, node)

    return refuses


def deflection_gate_open(config: DeciderConfig, ttft_pf: float) -> bool:
    """May a deflection be weighed at all for a request whose keep path's TTFT estimate is
    ``ttft_pf``? Only from ``deflect_gate_share`` of the TTFT SLO on (always when None, the
    paper). Below it the keep path meets the SLO with room: a deflection would shave a TTFT that
    needs no saving, and its chunks lengthen the steps of the decodes beside them on a node that
    P/D leaves to its decodes, a TBT cost the requests already there pay (never worse than P/D).
    From the line on, the keep path's queue is what Eq. 7 weighs a deflection against."""
    share = config.deflect_gate_share
    return share is None or ttft_pf >= share * config.ttft_slo_s


def pick_keep_decode_node(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> DecodeNodeState:
    """Least-loaded decode node for the P/D path: fresh nodes first, then nodes with room
    for the prompt's KV; ties broken by node id so the choice is deterministic. With the
    nodes' cached prefixes (``cached``, tokens by node id), the load is weighed with the
    transfer of the blocks each node lacks: a node that holds the conversation takes its next
    turn unless its decode steps are slower by more than the transfer it saves."""
    if not view.decode:
        raise NoHealthyNodeError("no decode node is registered")
    fresh = [n for n in view.decode if is_fresh(n.reported_at, now, config)] or list(view.decode)
    roomy = [n for n in fresh if n.free_kv_tokens >= prompt_tokens] or fresh
    hits = [cached_prefix(cached, n.node_id, prompt_tokens) for n in roomy] if cached else ()
    if any(hits):
        return min(
            zip(roomy, hits, strict=True),
            key=lambda nh: (
                _facts(models, config, nh[0]).load_s + models.kv_transfer_s(prompt_tokens - nh[1]),
                nh[0].node_id,
            ),
        )[0]
    return min(roomy, key=lambda n: (_facts(models, config, n).load_s, n.node_id))  # load_s = decode_load_s


def cached_prefix(cached: Mapping[str, int] | None, node_id: str, prompt_tokens: int) -> int:
    """The prompt tokens ``node_id`` has cached (0 when unknown), at most all but the last one,
    which a node always computes."""
    if not cached:
        return 0
    return max(0, min(cached.get(node_id, 0), prompt_tokens - 1))


def best_prefill_node(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> tuple[PrefillNodeState, float]:
    """The prefill node with the lowest prefill end (fresh nodes first), and that time: Eq. 1
    with ``keep_estimate="eq1"``, else ``packed_prefill_s``; with the nodes' cached prefixes
    (``cached``, tokens by node id) each node's covers its uncached tokens."""
    if not view.prefill:
        raise NoHealthyNodeError("no prefill node is registered")
    fresh = [n for n in view.prefill if is_fresh(n.reported_at, now, config)] or list(view.prefill)
    best: tuple[float, str, PrefillNodeState] | None = None
    if config.keep_estimate != "eq1":
        for n in fresh:
            hit = cached_prefix(cached, n.node_id, prompt_tokens) if cached else 0
            end = packed_prefill_s(models, n, prompt_tokens, hit, now)
            if best is None or (end, n.node_id) < best[:2]:
                best = (end, n.node_id, n)
        assert best is not None  # view.prefill is not empty
        return best[2], best[0]
    exec_s: dict[tuple[int, int], float] = {}  # Eq. 3 depends on the node only through its chunk size and hit
    for n in fresh:
        key = (n.chunk_tokens, cached_prefix(cached, n.node_id, prompt_tokens) if cached else 0)
        own = exec_s.get(key)
        if own is None:
            own = exec_s[key] = prefill_exec_s(models, prompt_tokens, n.chunk_tokens, key[1])
        ttft = prefill_queue_wait_s(models, n) + own  # = prefill_ttft_s, to the bit
        if best is None or (ttft, n.node_id) < best[:2]:
            best = (ttft, n.node_id, n)
    assert best is not None  # view.prefill is not empty
    return best[2], best[0]


def _scan_decode_nodes(
    models: LatencyModels,
    view: ClusterView,
    now: float,
    config: DeciderConfig,
    prompt_tokens: int,
    cached: Mapping[str, int] | None = None,
) -> tuple[DecodeNodeState, list[DecodeNodeState], list[_NodeFacts], bool]:
    """One pass over the decode nodes for ``decide``: the keep path's node
    (``pick_keep_decode_node``), the deflection candidates in view order with their facts, and
    whether any node could take a deflection but for the overload line.

    A candidate can take the deflection (``can_take_deflection``) and is not overloaded: the
    schedule search plans on the heartbeat's B alone, so it can still find a chunk for a node
    that the decodes on their way to it (backlog, incoming keeps) will push over the overload
    line; P/D would leave that node to its decodes (never worse than P/D). At 1,000 nodes this
    pass is a third of a decision: it reads each node's facts once."""
    if not view.decode:
        raise NoHealthyNodeError("no decode node is registered")
    guard = config.decode_overload_guard
    stale_after, limit = config.stale_after_s, config.max_pending_deflections
    eligible: list[DecodeNodeState] = []
    facts: list[_NodeFacts] = []
    any_can_take = False
    keep: DecodeNodeState | None = None  # least (load, id) among fresh nodes with room
    keep_load = math.inf
    any_fresh = False
    for n in view.decode:
        if now - n.reported_at > stale_after:  # is_fresh
            continue
        any_fresh = True
        if n.free_kv_tokens < prompt_tokens:
            continue
        f = n.derived
        if type(f) is not _NodeFacts or f.models is not models or not (f.config is config or f.config == config):
            f = _facts(models, config, n)
        load = f.load_s
        if keep is None or load < keep_load or (load == keep_load and n.node_id < keep.node_id):
            keep, keep_load = n, load
        if limit is None or len(n.prefill_backlog_tokens) < limit:
            any_can_take = True
            if not guard or load <= f.overload_s:  # the node's own line (its step calibration)
                eligible.append(n)
                facts.append(f)
    if keep is None or not any_fresh or cached:  # no fresh node with room, or cache hits to weigh
        keep = pick_keep_decode_node(models, view, now, config, prompt_tokens, cached)
    return keep, eligible, facts, any_can_take


def decide_without_prefill_pool(
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    models: LatencyModels,
    config: DeciderConfig,
    slo: RequestSLO | None = None,
) -> Decision:
    """Degraded routing while no fresh prefill node is registered (all dead, or their heartbeats
    lost on a starved host): a decode node prefills the request itself rather than the request
    failing, within the bounds a deflection has on the normal path. A candidate is fresh, has KV
    room for the prompt, is under the pending-deflection limit and under its overload line
    (``_scan_decode_nodes``); its schedule keeps every step within the node's step budget (Eq. 5)
    and finishes within the TTFT SLO (Eq. 7's second clause: with no prefill path there is no
    alpha clause, nor a keep path for the gate or the pressure rule to weigh). The fastest such
    node wins. When none qualifies: :class:`NoHealthyNodeError` (a 503) that says which bound held
    the nodes back, rather than a schedule no bound holds. ``slo``: the request's own SLOs, as
    in ``decide``."""
    validate_prompt(prompt_tokens)
    config = with_request_slo(config, slo)
    if not view.decode:
        raise NoHealthyNodeError("no prefill or decode node is registered")
    _, eligible, facts, any_can_take = _scan_decode_nodes(models, view, now, config, prompt_tokens)
    bound = config.ttft_slo_s
    if models.mixed_nonnegative and len(eligible) >= BOUNDED_SEARCH_MIN_NODES:
        best, any_too_slow = _search_bounded(models, config, eligible, prompt_tokens, bound, facts)
    else:
        best, any_too_slow = _search_in_id_order(models, config, eligible, prompt_tokens, bound)
    if best is None:
        if not any(is_fresh(n.reported_at, now, config) for n in view.decode):
            why = "no decode node is fresh either"
        elif any_can_take and not eligible:
            why = "every decode node with room for it is over its overload line (its decode-only step)"
        elif not eligible:
            why = "no fresh decode node has room for it (its KV, and a deflection slot under the pending limit)"
        elif any_too_slow:
            why = f"no decode node can prefill it within the TTFT SLO ({config.ttft_slo_s:g} s)"
        else:
            why = "no decode node has a TBT-safe schedule for it (every step within its step budget)"
        raise NoHealthyNodeError(
            f"no prefill node is available to prefill this {prompt_tokens}-token prompt, and {why}"
        )
    ttft_dec, node_id, plan = best
    sizes, times = expand_runs(plan.runs)
    return _deflect(
        Reason.DEFLECT_NO_PREFILL_NODE,
        node_id,
        sizes,
        times,
        plan.decode_tokens,
        None,
        ttft_dec,
        prompt_tokens,
        config,
        plan.step_budget_s,
        slo=slo,
    )


def _deflect(
    reason: Reason,
    node_id: str,
    sizes: list[int],
    times: list[float],
    decode_tokens: int,
    ttft_pf: float | None,
    ttft_dec: float | None,
    prompt_tokens: int,
    config: DeciderConfig,
    step_budget_s: float,
    cached_tokens: int = 0,
    slo: RequestSLO | None = None,
) -> Decision:
    """A deflection to ``node_id`` with its schedule, carrying the step budget the node enforces
    (the one it was planned to, ``node_step_budget_s``: a node that knows its decodes' TPOTs
    tightens it further by theirs, ``kairos.core.slo.tau_scaled_budget_s``)."""
    return Decision(
        route=Route.DEFLECT,
        reason=reason,
        decode_node=node_id,
        prefill_node=None,
        chunk_sizes=tuple(sizes),
        predicted_ttft_prefill_s=ttft_pf,
        predicted_ttft_decode_s=ttft_dec,
        prompt_tokens=prompt_tokens,
        step_budget_s=step_budget_s if config.node_step_guard else None,
        predicted_step_s=tuple(times),
        planned_decode_tokens=decode_tokens,
        cached_tokens=cached_tokens,
        slo=slo,
    )


# The deflection search: the decode node whose schedule gives the lowest TTFT within ``bound``,
# the lowest node id on a tie (then the first in the view), and whether any node's schedule
# was abandoned for running past the bound (rather than finding no TBT-safe chunk).
_Best = tuple[float, str, _Plan]
_PlanMemo = dict[tuple[int, int, tuple[int, ...], tuple[int, ...], float, int], "_Plan | str"]


def _cutoff(limit_s: float) -> float:
    """A lower bound above this says for sure that the schedule's TTFT, as computed, is above
    ``limit_s``."""
    return limit_s + abs(limit_s) * _BOUND_SLACK


def _memo_plan(
    memo: _PlanMemo,
    planner: Callable[[LatencyModels, DeciderConfig, DecodeNodeState, int, float, int], _Plan | str],
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up: float,
    cached_tokens: int = 0,
) -> _Plan | str:
    """``planner`` (``plan_on_decode_node`` or its equal), once per distinct node state (and
    cached prefix) in a search. Bounds only tighten during a search, and a schedule too slow for
    a looser bound is too slow for a tighter one."""
    key = (
        *planning_batch(config, node),
        node.prefill_backlog_tokens,
        node.prefill_backlog_computed_tokens,
        node.step_calibration,
        node.tpot_slo_s,
        cached_tokens,
    )
    plan = memo.get(key)
    if plan is None:
        plan = memo[key] = planner(models, config, node, prompt_tokens, give_up, cached_tokens)
    return plan


def _search_in_id_order(
    models: LatencyModels,
    config: DeciderConfig,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
) -> tuple[_Best | None, bool]:
    """Every node in id order, each schedule search abandoned once slower than both the bound
    and the best node so far (§4.4); none that ``refused`` (the decode pressure rule) refuses.
    The search for profiles ``_search_bounded`` cannot bound."""
    best: _Best | None = None
    any_too_slow = False
    memo: _PlanMemo = {}
    for node in sorted(eligible, key=lambda n: n.node_id):
        if refused is not None and refused(node):
            continue
        give_up = bound if best is None else min(bound, best[0])
        hit = cached_prefix(cached, node.node_id, prompt_tokens) if cached else 0
        plan = _memo_plan(memo, plan_on_decode_node, models, config, node, prompt_tokens, give_up, hit)
        if plan == _TOO_SLOW:
            any_too_slow = True
        elif isinstance(plan, _Plan) and (best is None or plan.ttft_s < best[0]):
            best = (plan.ttft_s, node.node_id, plan)
    return best, any_too_slow


def _search_bounded(
    models: LatencyModels,
    config: DeciderConfig,
    eligible: list[DecodeNodeState],
    prompt_tokens: int,
    bound: float,
    facts: list[_NodeFacts],
    cached: Mapping[str, int] | None = None,
    refused: Callable[[DecodeNodeState], bool] | None = None,
) -> tuple[_Best | None, bool]:
    """``_search_in_id_order``'s result, visiting only the nodes whose TTFT lower bound
    (``ttft_lower_bound_s``) can still beat the best so far, lowest bound first, and asking
    ``refused`` only of those.

    The same winner: it is the least (TTFT, node id, place in the view) among the nodes whose
    schedule fits the bound, and a node is skipped only when its bound, hence its TTFT, is above
    the best so far (or the bound). The same reason when none fits: a node skipped for the bound
    is searched after all if no node searched ran past it. ``facts``: each eligible node's. A
    node with a cached prefix has no such bound (its schedule leaves the node's path): 0, so it
    is always searched."""
    beyond: list[DecodeNodeState] = []  # cannot finish within the bound
    order: list[tuple[float, str, int, DecodeNodeState]] = []
    limit, cutoff = bound, _cutoff(bound)
    lower_bound = _lower_bound
    for i, node in enumerate(eligible):
        hit = cached_prefix(cached, node.node_id, prompt_tokens) if cached else 0
        lb = 0.0 if hit else lower_bound(facts[i], node, prompt_tokens)
        if lb > cutoff:
            beyond.append(node)
        else:
            order.append((lb, node.node_id, i, node))
    heapq.heapify(order)
    best: tuple[float, str, int, _Plan] | None = None
    any_too_slow = False
    memo: _PlanMemo = {}
    while order:
        lb, node_id, i, node = heapq.heappop(order)
        if lb > cutoff:
            break  # every node left has a bound at least this high
        if refused is not None and refused(node):
            continue
        hit = cached_prefix(cached, node_id, prompt_tokens) if cached else 0
        plan = _memo_plan(memo, _plan_on_path, models, config, node, prompt_tokens, limit, hit)
        if plan == _TOO_SLOW:
            any_too_slow = True
        elif isinstance(plan, _Plan) and (best is None or (plan.ttft_s, node_id, i) < best[:3]):
            best = (plan.ttft_s, node_id, i, plan)
            limit = min(bound, plan.ttft_s)
            cutoff = _cutoff(limit)
    if best is None:
        any_too_slow = any_too_slow or any(
            _memo_plan(memo, _plan_on_path, models, config, node, prompt_tokens, bound) == _TOO_SLOW
            for node in beyond  # no cached prefix there: those nodes had a bound
            if refused is None or not refused(node)
        )
        return None, any_too_slow
    return (best[0], best[1], best[3]), any_too_slow


def validate_prompt(prompt_tokens: int) -> None:
    if prompt_tokens < 1:
        raise InvalidRequestError(f"the prompt has {prompt_tokens} tokens; at least 1 is needed")


# ---------------------------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------------------------
def decide(
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    models: LatencyModels,
    config: DeciderConfig,
    cached: Mapping[str, int] | None = None,
    slo: RequestSLO | None = None,
) -> Decision:
    """Algorithm 1: keep on the best prefill node, or deflect to the decode node whose
    TBT-safe greedy schedule gives the lowest TTFT, when Eq. 7 holds against the keep path's
    TTFT estimate (``keep_ttft_s``: Eq. 1 and the KV hand-off to the keep path's decode node)
    and the keep path's TTFT is not under the gate's share of the SLO (``deflection_gate_open``).

    ``cached``: the prompt tokens each node (by id) has cached, when known. Then every path
    prefills only the node's uncached tokens: Eq. 3 on prefill node p starts from its prefix
    h_p, the schedule on decode node d covers l - h_d tokens each step over the h_d cached, and
    the keep path's decode node weighs the transfer of the blocks it lacks. None (or no hit
    anywhere) is the paper's decision, to the bit.

    ``slo``: the request's own SLOs (None: the cluster's, ``config``'s). Its TTFT SLO is Eq. 7's
    bound (and the gate's and the pressure rule's), its TPOT SLO Eq. 5's tau, tightened on each
    decode node by the node's tightest TPOT in flight (``node_step_budget_s``): a batch request
    plans an interactive node's steps to the interactive tau, an interactive request any node's
    to its own."""
    validate_prompt(prompt_tokens)
    config = with_request_slo(config, slo)
    prefill_node, prefill_s = best_prefill_node(models, view, now, config, prompt_tokens, cached)
    keep_decode, eligible, facts, any_can_take = _scan_decode_nodes(models, view, now, config, prompt_tokens, cached)
    keep_hit = cached_prefix(cached, keep_decode.node_id, prompt_tokens)
    ttft_pf = keep_ttft_s(models, config, prefill_s, keep_decode, prompt_tokens, keep_hit, now)
    refused = decode_pressure_refusal(models, config, prompt_tokens, ttft_pf)

    def keep(reason: Reason, ttft_dec: float | None) -> Decision:
        return Decision(
            route=Route.KEEP,
            reason=reason,
            decode_node=keep_decode.node_id,
            prefill_node=prefill_node.node_id,
            chunk_sizes=(),
            predicted_ttft_prefill_s=ttft_pf,
            predicted_ttft_decode_s=ttft_dec,
            prompt_tokens=prompt_tokens,
            predicted_prefill_end_s=prefill_s,
            cached_tokens=cached_prefix(cached, prefill_node.node_id, prompt_tokens),
            step_budget_s=keep_step_budget_s(config, keep_decode),
            slo=slo,
        )

    if not eligible:
        if any_can_take:
            return keep(Reason.KEEP_DECODE_OVERLOADED, None)
        return keep(Reason.KEEP_NO_ELIGIBLE_DECODE, None)
    if refused is not None and all(map(refused, eligible)):  # stops at the first node let through
        return keep(Reason.KEEP_DECODE_OVERLOADED, None)
    if not deflection_gate_open(config, ttft_pf):
        return keep(Reason.KEEP_SLO_ROOM, None)

    margin_s = config.alpha * ttft_pf
    bound = min(margin_s, config.ttft_slo_s)
    if models.mixed_nonnegative and len(eligible) >= BOUNDED_SEARCH_MIN_NODES:
        best, any_too_slow = _search_bounded(models, config, eligible, prompt_tokens, bound, facts, cached, refused)
    else:
        best, any_too_slow = _search_in_id_order(models, config, eligible, prompt_tokens, bound, cached, refused)

    if best is None:
        if not any_too_slow:
            return keep(Reason.KEEP_NO_SAFE_SCHEDULE, None)
        return keep(Reason.KEEP_DECODE_SLOWER if margin_s <= config.ttft_slo_s else Reason.KEEP_DECODE_OVER_SLO, None)

    ttft_dec, node_id, plan = best
    if ttft_dec > margin_s:
        return keep(Reason.KEEP_DECODE_SLOWER, ttft_dec)
    if ttft_dec > config.ttft_slo_s:
        return keep(Reason.KEEP_DECODE_OVER_SLO, ttft_dec)
    sizes, times = expand_runs(plan.runs)
    return _deflect(
        Reason.DEFLECT_WITHIN_MARGIN,
        node_id,
        sizes,
        times,
        plan.decode_tokens,
        ttft_pf,
        ttft_dec,
        prompt_tokens,
        config,
        plan.step_budget_s,
        cached_prefix(cached, node_id, prompt_tokens),
        slo,
    )
