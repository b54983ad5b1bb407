"""The typed output of every routing policy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kairos.common.contracts.routes import Route  # a Decision's route, imported from here too
from kairos.core.slo import RequestSLO


class Reason(StrEnum):
    """Why a decision came out the way it did; exported as a metric label."""

    DEFLECT_WITHIN_MARGIN = "deflect_within_margin"  # Eq. 7 holds on the fastest feasible node
    DEFLECT_STATIC_RULE = "deflect_static_rule"  # SQ/SL threshold fired
    DEFLECT_NO_PREFILL_NODE = "deflect_no_prefill_node"  # degraded: no prefill node registered
    SPLIT_WITHIN_MARGIN = "split_within_margin"  # no deflection meets Eq. 7; a split at some k does
    KEEP_DECODE_SLOWER = "keep_decode_slower"  # fastest decode TTFT > alpha x prefill TTFT
    KEEP_DECODE_OVER_SLO = "keep_decode_over_slo"  # fastest decode TTFT > TTFT SLO
    KEEP_NO_SAFE_SCHEDULE = "keep_no_safe_schedule"  # no node has a TBT-safe schedule
    KEEP_NO_ELIGIBLE_DECODE = "keep_no_eligible_decode"  # all decode nodes stale, busy or full
    KEEP_DECODE_OVERLOADED = "keep_decode_overloaded"  # every eligible node's decode-only step over its line
    KEEP_SLO_ROOM = "keep_slo_room"  # the keep path's TTFT is under the deflection gate's share of the SLO
    KEEP_STATIC_RULE = "keep_static_rule"  # SQ/SL threshold did not fire
    KEEP_POLICY = "keep_policy"  # the policy never deflects (P/D baseline)
    # The field's deciders (kairos.core.policies): <route>_<system>_<rule>
    DEFLECT_LLMD_THRESHOLD = "deflect_llmd_threshold"  # llm-d: uncached prompt below nonCachedTokens, or it is 0
    KEEP_LLMD_THRESHOLD = "keep_llmd_threshold"  # llm-d: uncached prompt at or above nonCachedTokens
    DEFLECT_DYNAMO_ISL = "deflect_dynamo_isl"  # Dynamo isl_bounding: short and mostly cached
    DEFLECT_DYNAMO_LOAD = "deflect_dynamo_load"  # Dynamo prefill_load: the chosen prefill node is busy
    KEEP_DYNAMO_RULE = "keep_dynamo_rule"  # Dynamo: no bypass condition held
    KEEP_DYNAMO_KV_GUARD = "keep_dynamo_kv_guard"  # Dynamo: bypass vetoed, decode KV over its busy line
    DEFLECT_AIBRIX_DRAIN = "deflect_aibrix_drain"  # AIBrix: a pool drains slowly, a decode node is idle
    KEEP_AIBRIX_DRAIN = "keep_aibrix_drain"  # AIBrix: no such imbalance


@dataclass(frozen=True, slots=True)
class ChunkStep:
    """One step of a deflected prefill on a decode node."""

    step_tokens: int  # chi: all tokens in the step (B decode tokens + the prefill chunk)
    prefill_tokens: int  # chi - B: this request's prompt tokens processed in the step
    cached_tokens: int  # this request's prompt tokens already cached before the step
    predicted_s: float  # predicted step latency (Eq. 4)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes, and why."""

    route: Route
    reason: Reason
    decode_node: str  # serves the decode phase (and the prefill, on deflect; the prompt's rest, on split)
    prefill_node: str | None  # the prefill node on keep and split, None on deflect
    # On deflect: prompt tokens per step (chi - B), what the decode node executes; on split, the
    # steps of the prompt after its first split_tokens; () on keep.
    chunk_sizes: tuple[int, ...]
    # The keep path's TTFT estimate on the chosen/best prefill node and the keep path's decode
    # node: Eq. 1 + KV transfer + link queue + admission + first decode step
    # (kairos.core.algorithm.keep_ttft_s), or Eq. 1 alone with keep_estimate="eq1".
    predicted_ttft_prefill_s: float | None
    predicted_ttft_decode_s: float | None  # Eq. 6 on the best feasible decode node, if any
    prompt_tokens: int
    # On deflect: the step-time budget (DeciderConfig.step_budget_s) the decode node enforces on
    # each chunk with its own model and the batch it has at that step; None leaves it unguarded.
    # On keep: the decode node's, for its sidecar's local prefill should the prefill node fail.
    step_budget_s: float | None = None
    predicted_step_s: tuple[float, ...] = ()  # Eq. 4 for each scheduled step
    planned_decode_tokens: int = 0  # the B the schedule was planned beside
    # On keep: Eq. 1 alone, when the prefill is predicted to end (the KV then leaves the prefill
    # node); None where it equals predicted_ttft_prefill_s or there is no keep estimate.
    predicted_prefill_end_s: float | None = None
    # Prompt tokens the prefilling node (the decode node on deflect, the prefill node on keep)
    # has cached, as the decision read them: a deflection's schedule covers the rest.
    cached_tokens: int = 0
    # The request's own SLOs it was decided with (Eq. 7's TTFT bound, its share of Eq. 5's tau);
    # None: a policy that reads none (every request judged by the cluster's).
    slo: RequestSLO | None = None
    # On split: k, the prompt's leading tokens the prefill node computes (their KV pulled by the
    # decode node, which prefills the rest); 0 on keep and deflect.
    split_tokens: int = 0

    def __post_init__(self) -> None:
        if self.route is Route.DEFLECT and (not self.chunk_sizes or self.prefill_node is not None):
            raise ValueError("a deflect decision needs a schedule and no prefill node")
        if self.route is Route.KEEP and (self.chunk_sizes or self.prefill_node is None):
            raise ValueError("a keep decision needs a prefill node and no schedule")
        if self.route is Route.SPLIT and (
            not self.chunk_sizes
            or self.prefill_node is None
            or not 0 < self.split_tokens < self.prompt_tokens
            or sum(self.chunk_sizes) != self.prompt_tokens - self.split_tokens
        ):
            raise ValueError(
                f"a split decision needs a prefill node, 0 < split_tokens ({self.split_tokens}) < prompt tokens "
                f"({self.prompt_tokens}) and a schedule of the rest (it covers {sum(self.chunk_sizes)})"
            )
        if self.route is not Route.SPLIT and self.split_tokens:
            raise ValueError(f"split_tokens={self.split_tokens} on a {self.route} decision")
        if self.route is Route.DEFLECT and sum(self.chunk_sizes) != self.prompt_tokens - self.cached_tokens:
            raise ValueError(
                f"schedule covers {sum(self.chunk_sizes)} tokens, prompt has {self.prompt_tokens} "
                f"of which {self.cached_tokens} cached"
            )
        if self.predicted_step_s and len(self.predicted_step_s) != len(self.chunk_sizes):
            raise ValueError(f"{len(self.predicted_step_s)} step times for {len(self.chunk_sizes)} chunks")

    @property
    def schedule(self) -> tuple[ChunkStep, ...]:
        """The schedule step by step, with each step's size, cached tokens and predicted time."""
        steps, cached = [], self.split_tokens if self.route is Route.SPLIT else self.cached_tokens
        times = self.predicted_step_s or (float("nan"),) * len(self.chunk_sizes)
        for p, t in zip(self.chunk_sizes, times, strict=True):
            steps.append(ChunkStep(self.planned_decode_tokens + p, p, cached, t))
            cached += p
        return tuple(steps)
