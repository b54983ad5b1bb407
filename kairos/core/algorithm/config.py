"""Algorithm 1's settings (:class:`DeciderConfig`, the paper's defaults) and the lines they draw
on one decode node: the request's own SLOs in place of the cluster's, Eq. 5's step budget at the
node's tau and step calibration, and its overload line."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from statistics import NormalDist

from kairos.common import defaults
from kairos.common.config import setting
from kairos.common.errors import ConfigError
from kairos.core.slo import RequestSLO
from kairos.core.state import DecodeNodeState

DEFAULT_CHUNK_CANDIDATES = defaults.CHUNK_CANDIDATES
# A step predicted at t runs up to t x (1 + _P95_SIGMAS_PER_MAE x model_error) at its 95th
# percentile when the model's relative errors are normal with that mean absolute value: z(0.95)
# sigmas, and sigma = sqrt(pi/2) x MAE. The TBT SLO is a P95, so that is the margin it needs.
_P95_SIGMAS_PER_MAE = NormalDist().inv_cdf(0.95) * math.sqrt(math.pi / 2)
KEEP_ESTIMATES = ("full", "eq1")  # DeciderConfig.keep_estimate
SPLIT_CHOICES = ("offload", "fastest", "off")  # DeciderConfig.split


@dataclass(frozen=True, slots=True)
class DeciderConfig:
    """Knobs of Algorithm 1. Defaults are the paper's (§6.1)."""

    alpha: float = setting(defaults.ALPHA, help="deflect when TTFT_dec <= alpha x TTFT_pf (Eq. 7); >= 1")
    beta: float = setting(defaults.BETA, help="TBT safety factor: every scheduled step <= beta x tau (Eq. 5); (0, 2]")
    tbt_slo_s: float = setting(
        defaults.TBT_SLO_S, help="tau, the TBT (TPOT) SLO in seconds, for requests that set none"
    )
    ttft_slo_s: float = setting(
        defaults.TTFT_SLO_S, help="the TTFT SLO of Eq. 7 in seconds, for requests that set none"
    )
    chunk_candidates: tuple[int, ...] = setting(
        DEFAULT_CHUNK_CANDIDATES,
        help="the chunk sizes a schedule picks from, strictly decreasing",
        flags=("--chunk-candidates", "--chunks"),
    )
    stale_after_s: float = setting(
        defaults.STALE_AFTER_S,
        help="a node whose heartbeat has not changed for this long is stale: no deflection to it",
    )
    # 1 is the paper's §5.3 rule; None schedules a new deflection behind the node's backlog.
    max_pending_deflections: int | None = setting(
        defaults.MAX_PENDING_DEFLECTIONS,
        help="deflected prefills a decode node may hold in flight (reported backlog + dispatches since its "
        "heartbeat) for it to take another; none lifts the limit",
    )
    # Decodes join between heartbeats: the node shrinks a chunk whose step would overrun the
    # budget with the batch it actually has then.
    node_step_guard: bool = setting(True, help="send step_budget_s with each schedule, for the node's step guard")
    # False is the paper's Algorithm 1: only to measure what the rule changes.
    decode_overload_guard: bool = setting(
        True, help="deflect to no node whose decode-only step is already over decode_overload_s"
    )
    # Its decodes are the cluster's bottleneck then, and the chunks would take their time to save
    # a TTFT that meets its SLO anyway.
    decode_pressure_share: float | None = setting(
        defaults.DECODE_PRESSURE_SHARE,
        help="with the overload guard, while the keep path meets the TTFT SLO: deflect to no node whose "
        "decode-only step with the request joined is over this share of decode_overload_s; none: no such rule",
    )
    # None: Eq. 7 decides alone (the paper).
    deflect_gate_share: float | None = setting(
        defaults.DEFLECT_GATE_SHARE,
        help="no deflection while the keep path's TTFT estimate is under this share of the TTFT SLO; none: no gate",
    )
    # Schedules planned to the budget's edge with an erring model overrun tau on about half their
    # steps, where P/D's shorter decode-only steps rarely do: both step lines shrink by the
    # error's P95 (see step_budget_s).
    model_error: float = setting(
        0.0,
        help="the step model's mean absolute relative error against the nodes' real step times (a profile's "
        "held-out MAPE); 0 trusts the model",
    )
    # Both step lines are divided by the node's reported calibration (DecodeNodeState.step_calibration,
    # the 99th percentile of its actual / predicted step times), so its steps with deflected
    # chunks stay under tau 99% of the time however far its model is off; it composes with beta
    # and model_error. A node that reports none counts 1.0.
    calibrate: bool = setting(True, help="plan each decode node's steps to its own reported step calibration")
    # "full": keep_ttft_s, Eq. 1 + the KV transfer behind the decode node's link queue + its
    # admission wait + its first decode step, after the step the node is running then; the
    # deflection's estimate then starts at the node's next step (backlog_end). "eq1": the
    # paper's Eq. 1 and Eq. 6 alone, for comparison.
    keep_estimate: str = setting(
        defaults.KEEP_ESTIMATE, help=f"the keep path's TTFT estimate Eq. 7 compares with: {' or '.join(KEEP_ESTIMATES)}"
    )
    # Memoryless: how fast a decode node frees KV, for the keep path's admission wait when the
    # node's KV cannot take the prompt now.
    mean_output_tokens: float = setting(
        defaults.MEAN_OUTPUT_TOKENS, help="a running decode's mean remaining output tokens"
    )
    # Each pulled keep joins the batch within the link's time and the node's step guard shrinks
    # each chunk to the batch it has then, so a plan on the heartbeat's B alone promised a first
    # token they delayed. False plans on B alone (the paper).
    plan_with_pulls: bool = setting(
        True, help="plan a deflection beside the decodes whose KV the node is pulling (pending_kv_pull_tokens)"
    )

    # The split route (kairos.core.algorithm.split): when neither deflection meets Eq. 7, the
    # prompt's first k tokens on the prefill node and the rest on a decode node.
    split: str = setting(
        defaults.SPLIT,
        help="the split route's k: offload (the smallest k whose TTFT meets Eq. 7's bound), fastest (the k of the "
        "lowest TTFT, when below the keep path's) or off",
    )
    split_points: int = setting(
        defaults.SPLIT_POINTS, help="the split's k search: the prompt cut into this many equal parts (>= 2)"
    )
    kv_block_tokens: int = setting(
        defaults.KV_BLOCK_TOKENS, help="the nodes' KV block size in tokens: a split's k is a multiple of it"
    )

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
        if self.split not in SPLIT_CHOICES:
            raise ConfigError(f"split must be one of {list(SPLIT_CHOICES)}, got {self.split!r}")
        if self.split_points < 2 or self.kv_block_tokens < 1:
            raise ConfigError(
                f"split_points must be >= 2 and kv_block_tokens >= 1, got {self.split_points}, {self.kv_block_tokens}"
            )
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
    # (``node_facts``), kept for the config they were built with, stay valid across them.
    return dataclasses.replace(config, ttft_slo_s=ttft_s, tbt_slo_s=tpot_s)


def tau_share(config: DeciderConfig, node: DecodeNodeState) -> float:
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
    share = tau_share(config, node)
    return budget if share == 1.0 else budget * share


def keep_step_budget_s(config: DeciderConfig, node: DecodeNodeState) -> float | None:
    """The step budget a keep carries for its decode node ``node`` (None without the node step
    guard): should the prefill node fail it, the node's sidecar prefills it there, and the
    node's guard holds those steps to this budget, as a deflection's."""
    return node_step_budget_s(config, node) if config.node_step_guard else None


def node_overload_s(config: DeciderConfig, node: DecodeNodeState) -> float:
    """``config.decode_overload_s`` on ``node``, at the node's tau (``node_step_budget_s``) and
    divided by its step calibration likewise."""
    line = config.decode_overload_s * tau_share(config, node)
    return line / node.step_calibration if config.calibrate else line
