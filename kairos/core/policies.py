"""Routing policies: the Kairos decision and the baselines it is compared with.

Every policy maps (prompt tokens, cluster view, now) to a :class:`Decision`. Build one from a
spec string such as ``kairos:alpha=1.3,beta=0.9`` with :func:`make_policy`, which raises on
unknown names and parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kairos.common import defaults
from kairos.common.errors import UnknownPolicyError
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.slo import RequestSLO
from kairos.core.state import ClusterView, DecodeNodeState


class Policy(Protocol):
    """What the simulator and the dispatcher need from a policy."""

    @property
    def label(self) -> str:
        """Short name with parameters, for tables and plots, e.g. ``kairos(a=1.3,b=1)``."""
        ...

    @property
    def fresh_state(self) -> bool:
        """True for the Oracle: the simulator hands it the true state, not the last heartbeat."""
        ...

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision: ...


# Policies that read the nodes' prefix caches (``kairos``, ``oracle``, ``pd``) say so with a
# ``prefix_aware`` attribute, and then take ``decide(..., cached=...)``: the prompt tokens each
# node has cached, by node id. ``prefix=off`` makes them cache-blind, for comparison.
# Policies that read a request's own SLOs (``kairos``, ``oracle``, unless ``slo=off``) say so with
# an ``slo_aware`` attribute, and then take ``decide(..., slo=...)`` (kairos.core.slo.RequestSLO).


def _keep(
    models: LatencyModels,
    cfg: alg.DeciderConfig,
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    reason: Reason,
    cached: Mapping[str, int] | None = None,
) -> Decision:
    prefill, prefill_s = alg.best_prefill_node(models, view, now, cfg, prompt_tokens, cached)
    decode = alg.pick_keep_decode_node(models, view, now, cfg, prompt_tokens, cached)
    ttft_pf = alg.keep_ttft_s(
        models, cfg, prefill_s, decode, prompt_tokens, alg.cached_prefix(cached, decode.node_id, prompt_tokens), now
    )
    hit = alg.cached_prefix(cached, prefill.node_id, prompt_tokens)
    return Decision(
        Route.KEEP,
        reason,
        decode.node_id,
        prefill.node_id,
        (),
        ttft_pf,
        None,
        prompt_tokens,
        predicted_prefill_end_s=prefill_s,
        cached_tokens=hit,
        step_budget_s=alg.keep_step_budget_s(cfg, decode),
    )


def _fixed_chunk_schedule(
    models: LatencyModels, decode_tokens: int, kv_tokens: int, prompt_tokens: int, step_tokens: int
) -> tuple[list[int], list[float]]:
    """A prompt prefilled the way a vLLM engine's chunked prefill does it with a token budget of
    ``step_tokens`` per step: the running decodes first, the prompt's next chunk fills the rest
    (chi - B tokens), whatever that does to the step time. Needs ``step_tokens > decode_tokens``."""
    sizes: list[int] = []
    times: list[float] = []
    room = step_tokens - decode_tokens
    cached = 0
    while cached < prompt_tokens:
        p = min(room, prompt_tokens - cached)
        sizes.append(p)
        times.append(models.mixed_step_s(decode_tokens + p, cached, decode_tokens, kv_tokens + cached))
        cached += p
    return sizes, times


def _can_prefill_locally(
    node: DecodeNodeState, now: float, config: alg.DeciderConfig, prompt_tokens: int, step_tokens: int
) -> bool:
    """A decode node the gateway may hand a whole request to: fresh heartbeat, room for the
    prompt's KV, and a step budget its running decodes do not already fill."""
    return (
        alg.is_fresh(node.reported_at, now, config)
        and node.free_kv_tokens >= prompt_tokens
        and node.decode_tokens < step_tokens
    )


def _prefill_locally(
    models: LatencyModels,
    config: alg.DeciderConfig,
    view: ClusterView,
    now: float,
    node: DecodeNodeState,
    prompt_tokens: int,
    step_tokens: int,
    reason: Reason,
) -> Decision:
    """Deflect to ``node`` with the fixed-budget schedule and no step guard (no baseline has one)."""
    sizes, times = _fixed_chunk_schedule(models, node.decode_tokens, node.kv_tokens, prompt_tokens, step_tokens)
    _, ttft_pf = alg.best_prefill_node(models, view, now, config, prompt_tokens)
    return Decision(
        Route.DEFLECT,
        reason,
        node.node_id,
        None,
        tuple(sizes),
        ttft_pf,
        sum(times),
        prompt_tokens,
        predicted_step_s=tuple(times),
        planned_decode_tokens=node.decode_tokens,
    )


@dataclass(frozen=True)
class PDPolicy:
    """Plain P/D disaggregation: never deflect. Prefix-aware (the default), it picks the prefill
    node by Eq. 1 over each node's uncached tokens and the decode node by load and the blocks it
    lacks, as the field's prefix-aware routers do."""

    models: LatencyModels
    config: alg.DeciderConfig
    fresh_state: bool = False
    prefix_aware: bool = True

    @property
    def label(self) -> str:
        return "pd" if self.prefix_aware else "pd(prefix=off)"

    def decide(
        self, prompt_tokens: int, view: ClusterView, now: float, cached: Mapping[str, int] | None = None
    ) -> Decision:
        alg.validate_prompt(prompt_tokens)
        hits = cached if self.prefix_aware else None
        return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_POLICY, hits)


@dataclass(frozen=True)
class StaticPolicy:
    """The static deflection rules of §3.4, each with a fixed step size chi (128 in the paper):

    - SQ(theta): deflect when every prefill node's queue holds more than theta requests;
    - SL(l): deflect every request whose prompt is shorter than l tokens.

    They ignore TBT: the deflected request runs chi - B prefill tokens per step on the
    least-loaded fresh decode node, whatever that does to the node's step time.
    """

    models: LatencyModels
    config: alg.DeciderConfig
    kind: str  # "sq" or "sl"
    threshold: int  # theta (requests) for SQ, l (tokens) for SL
    chunk_tokens: int = 128
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"sq(theta={self.threshold})" if self.kind == "sq" else f"sl(l={self.threshold})"

    def _fires(self, prompt_tokens: int, view: ClusterView, now: float) -> bool:
        if self.kind == "sl":
            return prompt_tokens < self.threshold
        fresh = [n for n in view.prefill if alg.is_fresh(n.reported_at, now, self.config)]
        return bool(fresh) and all(n.queue_length > self.threshold for n in fresh)

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        if not self._fires(prompt_tokens, view, now):
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_STATIC_RULE)
        fresh = [n for n in view.decode if _can_prefill_locally(n, now, self.config, prompt_tokens, self.chunk_tokens)]
        if not fresh:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        node = min(fresh, key=lambda n: (alg.decode_load_s(self.models, n), n.node_id))
        return _prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_STATIC_RULE
        )


@dataclass(frozen=True)
class KairosPolicy:
    """Algorithm 1. As the Oracle (§3.4) it is the same decision fed the simulator's true state."""

    models: LatencyModels
    config: alg.DeciderConfig
    fresh_state: bool = False
    prefix_aware: bool = True  # read the nodes' cached prefixes when the caller has them
    # Decide each request by its own SLOs when the caller has them; False: one global SLO (config's).
    slo_aware: bool = True

    @property
    def label(self) -> str:
        name = "oracle" if self.fresh_state else "kairos"
        guard = "" if self.config.node_step_guard else ",guard=off"
        overload = "" if self.config.decode_overload_guard else ",overload=off"
        error = f",error={self.config.model_error:g}" if self.config.model_error else ""
        calibrate = "" if self.config.calibrate else ",calibrate=off"
        pulls = "" if self.config.plan_with_pulls else ",pulls=off"
        keep = "" if self.config.keep_estimate == defaults.KEEP_ESTIMATE else f",keep={self.config.keep_estimate}"
        limit = self.config.max_pending_deflections
        pending = "" if limit == defaults.MAX_PENDING_DEFLECTIONS or self.fresh_state else f",pending={limit or 'none'}"
        share = self.config.decode_pressure_share
        pressure = "" if share == defaults.DECODE_PRESSURE_SHARE else f",pressure={share or 'off'}"
        gate_share = self.config.deflect_gate_share
        gate = "" if gate_share == defaults.DEFLECT_GATE_SHARE else f",gate={_share_label(gate_share)}"
        prefix = "" if self.prefix_aware else ",prefix=off"
        prefix += "" if self.slo_aware else ",slo=off"
        cands = self.config.chunk_candidates
        chunks = "" if cands == defaults.CHUNK_CANDIDATES else f",chunks={format_chunks(cands)}"
        knobs = f"{pending}{guard}{overload}{pressure}{gate}{error}{calibrate}{pulls}{keep}{prefix}{chunks}"
        return f"{name}(alpha={self.config.alpha:g},beta={self.config.beta:g}{knobs})"

    def decide(
        self,
        prompt_tokens: int,
        view: ClusterView,
        now: float,
        cached: Mapping[str, int] | None = None,
        slo: RequestSLO | None = None,
    ) -> Decision:
        hits = cached if self.prefix_aware else None
        return alg.decide(prompt_tokens, view, now, self.models, self.config, hits, slo if self.slo_aware else None)


# ---------------------------------------------------------------------------------------------
# The field's deciders, as baselines. Each decides keep or prefill-on-the-decode-node with its
# own rule on what Kairos's heartbeats show; where the original reads a signal Kairos does not
# have, the docstring says what stands in for it. They do not read the nodes' prefix caches
# here (only kairos, oracle and pd do), so a prompt's uncached ("effective") length is its
# whole length, as on cache-cold traffic. A request they prefill on a
# decode node runs as vLLM's chunked prefill would run it there: a fixed token budget per step
# (the decode nodes' max_num_batched_tokens), decodes first, the prompt filling the rest, and
# no TBT guard, since none of the three plans or bounds the steps it adds.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlmdPolicy:
    """llm-d's P/D decider (llm-d-inference-scheduler, ``prefix-based-pd-decider`` under
    ``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/``; read at commit 520af47).

    Rule: the decode profile picks the decode pod first; the decider then disaggregates (remote
    prefill) when the prompt's tokens not cached on that pod are at least ``nonCachedTokens``,
    and otherwise the decode pod runs the whole request. ``nonCachedTokens = 0`` (the plugin's
    own default) turns disaggregation off: every request runs on its decode pod.

    Parameters: ``threshold`` = nonCachedTokens, default 16 (the repo's P/D deployment config
    ``deploy/config/pd-epp-config.yaml``; its docs' example uses 8); ``chunk`` = the decode
    node's per-step token budget. llm-d estimates tokens as characters / 4; Kairos counts them.

    Kairos mapping: uncached tokens = the prompt's tokens; the decode pod = the keep path's
    least-loaded decode node (llm-d scores by prefix hits and queue length). A node that is
    stale, lacks KV room for the prompt or whose decodes fill the step budget cannot take it
    (the request is kept).
    """

    models: LatencyModels
    config: alg.DeciderConfig
    threshold: int = 16
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"llmd(threshold={self.threshold}{_chunk_label(self.chunk_tokens)})"

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        uncached = prompt_tokens  # cache-blind here (see above)
        if self.threshold != 0 and uncached >= self.threshold:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_LLMD_THRESHOLD)
        node = alg.pick_keep_decode_node(self.models, view, now, self.config, prompt_tokens)
        if not _can_prefill_locally(node, now, self.config, prompt_tokens, self.chunk_tokens):
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        return _prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_LLMD_THRESHOLD
        )


DYNAMO_MODES = ("isl", "load", "either")


@dataclass(frozen=True)
class DynamoPolicy:
    """NVIDIA Dynamo's conditional disaggregation (experimental; ai-dynamo/dynamo,
    ``lib/kv-router/src/conditional_disagg.rs``, the call site
    ``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs`` and the "Conditional
    Disaggregation" docs page; read at commits 088ca50 / 07a6c9c).

    The router peeks at the decode worker it would pick, then bypasses remote prefill (prefill
    and decode on that worker) when the policy says so:

    - ``isl`` (``isl_bounding``, Dynamo's default policy): effective ISL < ``eff_isl_threshold``
      (2048) and effective / raw ISL < ``eff_isl_ratio_threshold`` (0.7), both strict;
    - ``load`` (``prefill_load``): the prefill worker the router would pick is busy,
      ``active_prefill_tokens > prefill_busy_threshold x max_num_batched_tokens``; the busy
      threshold inherits ``router_queue_threshold`` when unset, whose default has moved between
      releases (unset, 4.0 in the ``KvRouterConfig`` default read here, 16.0 in a later router
      README): ``busy`` defaults to 4;
    - ``either`` (``isl_or_load``): either condition.

    The decode-busy guard then vetoes a bypass when the decode worker's projected active KV
    (this request included) exceeds ``decode_busy_threshold`` x its KV capacity. Dynamo leaves it
    unset (off) by default; its B200/H200 recipes set 0.5, which is the default here
    (``kv=off`` disables it).

    Kairos mapping: effective ISL = the prompt's tokens and the ratio is 1 (hits not read here),
    so ``isl`` alone never bypasses here, exactly as in Dynamo on cache-cold traffic; the prefill
    worker = the prefill node with the lowest Eq. 1 TTFT, its active tokens = the prefill tokens
    its heartbeat queues (plus this dispatcher's dispatches since), max_num_batched_tokens = its
    chi_p; the decode worker = the keep path's least-loaded decode node, its projected KV =
    used + promised (deflected backlog, incoming keeps) + this prompt.
    """

    models: LatencyModels
    config: alg.DeciderConfig
    mode: str = "isl"
    isl_tokens: int = 2048
    isl_ratio: float = 0.7
    prefill_busy: float = 4.0
    kv_busy: float | None = 0.5  # None: the guard is off
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        kv = "off" if self.kv_busy is None else f"{self.kv_busy:g}"
        return (
            f"dynamo(mode={self.mode},isl={self.isl_tokens},ratio={self.isl_ratio:g},busy={self.prefill_busy:g},"
            f"kv={kv}{_chunk_label(self.chunk_tokens)})"
        )

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        effective = prompt_tokens  # cache-blind here (see above)
        isl = (
            self.mode in ("isl", "either")
            and effective < self.isl_tokens
            and effective / prompt_tokens < self.isl_ratio
        )
        load = False
        if self.mode in ("load", "either"):
            prefill, _ = alg.best_prefill_node(self.models, view, now, self.config, prompt_tokens)
            load = prefill.outstanding_tokens > self.prefill_busy * prefill.chunk_tokens
        if not (isl or load):
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_DYNAMO_RULE)
        node = alg.pick_keep_decode_node(self.models, view, now, self.config, prompt_tokens)
        if self.kv_busy is not None:
            projected = node.kv_capacity_tokens - node.free_kv_tokens + prompt_tokens
            if projected > self.kv_busy * node.kv_capacity_tokens:
                return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_DYNAMO_KV_GUARD)
        if not _can_prefill_locally(node, now, self.config, prompt_tokens, self.chunk_tokens):
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        reason = Reason.DEFLECT_DYNAMO_ISL if isl else Reason.DEFLECT_DYNAMO_LOAD
        return _prefill_locally(self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, reason)


@dataclass(frozen=True)
class AibrixPolicy:
    """AIBrix's fallback from prefill/decode pairs to combined pods (vllm-project/aibrix,
    ``pkg/plugins/gateway/algorithms/pd_disaggregation.go`` ``shouldPickCombined`` and
    ``scoreCombinedPods``, the score in ``scorer.go``; ``docs/source/features/pd-disaggregation.rst``;
    read at commit e3e10f9).

    Each pod's drain score is its backlog over its drain rate, (waiting requests + prefill and
    decode pre-allocation queues) / finished requests per second over the last minute: roughly
    the seconds it needs to clear what waits. A request goes to a combined pod (one that runs
    prefill and decode itself) when some combined pod scores below 0.25 and some prefill pod,
    or else some decode pod, scores above 1.0; the combined pod with the lowest score takes it.
    Both thresholds are constants in AIBrix; here ``low`` and ``high`` (seconds). AIBrix checks
    this only with prompt-length bucketing on and combined pods deployed (its other use of them,
    a prompt outside every bucket, has no counterpart here).

    Kairos mapping: Kairos has no separate combined pool; a decode node is the combined pod
    when it prefills a request itself. The drain score is the model's estimate of the same
    quantity, seconds to clear the queued work: a prefill node's Eq. 2 queue wait (its queued
    prefill tokens), a decode node's time to run its deflected backlog with the fixed-budget
    schedule. Ties go to the less loaded node, then the node id (AIBrix shuffles).
    """

    models: LatencyModels
    config: alg.DeciderConfig
    high_s: float = 1.0
    low_s: float = 0.25
    chunk_tokens: int = defaults.DECODE_STEP_TOKENS
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"aibrix(high={self.high_s:g},low={self.low_s:g}{_chunk_label(self.chunk_tokens)})"

    def decode_drain_s(self, node: DecodeNodeState) -> float:
        """Seconds to run the node's deflected backlog, each prompt joining the batch once done."""
        b, k, total = node.decode_tokens, node.kv_tokens, 0.0
        for backlog in node.prefill_backlog_tokens:
            if b >= self.chunk_tokens:
                return math.inf  # its decodes fill every step: the backlog never drains
            total += sum(_fixed_chunk_schedule(self.models, b, k, backlog, self.chunk_tokens)[1])
            b, k = b + 1, k + backlog
        return total

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)

        cfg = self.config
        prefill_high = any(
            alg.prefill_queue_wait_s(self.models, n) > self.high_s
            for n in view.prefill
            if alg.is_fresh(n.reported_at, now, cfg)
        )
        # AIBrix looks at the decode pods only when no prefill pod is over the line
        high = prefill_high or any(
            self.decode_drain_s(n) > self.high_s for n in view.decode if alg.is_fresh(n.reported_at, now, cfg)
        )
        if not high:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_AIBRIX_DRAIN)
        eligible = [
            n for n in view.decode if _can_prefill_locally(n, now, self.config, prompt_tokens, self.chunk_tokens)
        ]
        if not eligible:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        scored = [(self.decode_drain_s(n), alg.decode_load_s(self.models, n), n.node_id, n) for n in eligible]
        drain, _, _, node = min(scored, key=lambda x: x[:3])
        if not drain < self.low_s:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_AIBRIX_DRAIN)
        return _prefill_locally(
            self.models, self.config, view, now, node, prompt_tokens, self.chunk_tokens, Reason.DEFLECT_AIBRIX_DRAIN
        )


def _share_label(share: float | None) -> str:
    return "off" if share is None else f"{share:g}"


def _chunk_label(chunk_tokens: int) -> str:
    return "" if chunk_tokens == defaults.DECODE_STEP_TOKENS else f",chunk={chunk_tokens}"


@dataclass(frozen=True)
class NoPrefillPoolPolicy:
    """The gateway's degraded mode, not a routing policy to compare: with no prefill node
    registered, a decode node prefills the request itself (see
    :func:`kairos.core.algorithm.decide_without_prefill_pool`)."""

    models: LatencyModels
    config: alg.DeciderConfig
    label: str = "no-prefill-pool"
    fresh_state: bool = False
    slo_aware: bool = True

    def applies(self, view: ClusterView, now: float) -> bool:
        """No fresh prefill node, and a fresh decode node to prefill instead."""
        fresh = lambda nodes: any(alg.is_fresh(n.reported_at, now, self.config) for n in nodes)  # noqa: E731
        return not fresh(view.prefill) and fresh(view.decode)

    def decide(self, prompt_tokens: int, view: ClusterView, now: float, slo: RequestSLO | None = None) -> Decision:
        return alg.decide_without_prefill_pool(prompt_tokens, view, now, self.models, self.config, slo)


POLICY_NAMES = ("pd", "sq", "sl", "kairos", "oracle", "llmd", "dynamo", "aibrix")
# Algorithm 1's parameters, the Kairos policy's and the Oracle's.
_DECIDER_PARAMS = (
    "alpha",
    "beta",
    "guard",
    "overload",
    "pressure",
    "gate",
    "error",
    "calibrate",
    "keep",
    "prefix",
    "chunks",
    "pulls",
    "slo",
)
_PARAMS: dict[str, tuple[str, ...]] = {
    "pd": ("prefix",),
    "sq": ("theta", "chunk"),
    "sl": ("l", "chunk"),
    "kairos": ("pending", *_DECIDER_PARAMS),
    "oracle": _DECIDER_PARAMS,  # it sees the true backlog: no pending limit to set
    "llmd": ("threshold", "chunk"),
    "dynamo": ("mode", "isl", "ratio", "busy", "kv", "chunk"),
    "aibrix": ("high", "low", "chunk"),
}


CHUNKS_SEPARATOR = "/"  # in a spec's chunks=... value: "," separates the spec's parameters


def format_chunks(candidates: tuple[int, ...]) -> str:
    """``(2048, 1024)`` -> ``"2048/1024"``, as a spec's ``chunks=`` takes them."""
    return CHUNKS_SEPARATOR.join(map(str, candidates))


def parse_chunks(name: str, raw: str) -> tuple[int, ...]:
    """A spec's ``chunks=2048/1024/512/256/128`` (``DeciderConfig`` checks their order)."""
    try:
        return tuple(int(x) for x in raw.split(CHUNKS_SEPARATOR))
    except ValueError:
        raise UnknownPolicyError(f"policy {name!r}: chunks={raw!r} must be integers separated by '/'") from None


def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"kairos:alpha=1.3,beta=0.9"`` -> ``("kairos", {"alpha": "1.3", "beta": "0.9"})``."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _PARAMS:
        raise UnknownPolicyError(f"unknown policy {name!r} in {spec!r}; known policies: {list(POLICY_NAMES)}")
    params: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in _PARAMS[name]:
            raise UnknownPolicyError(
                f"policy {name!r}: bad parameter {item!r} in {spec!r}; accepted: {list(_PARAMS[name]) or 'none'}"
            )
        params[key] = value.strip()
    return name, params


def validate_gateway_policy(spec: str) -> None:
    """Fail at startup, not at the first request: the spec must parse, and it must not need the
    simulator's true state (the Oracle)."""
    name, _ = parse_policy_spec(spec)
    if name == "oracle":
        raise UnknownPolicyError(
            f"the oracle policy needs the simulator's true state; the gateway runs one of "
            f"{[n for n in POLICY_NAMES if n != 'oracle']}"
        )


def make_policy(spec: str, models: LatencyModels, base: alg.DeciderConfig | None = None) -> Policy:
    """Build a policy from a spec string; ``base`` supplies the SLOs and chunk candidates (a
    Kairos spec's ``chunks=`` overrides the latter)."""
    name, params = parse_policy_spec(spec)
    cfg = base or alg.DeciderConfig()

    def number(key: str, default: float, cast: type = float) -> float:
        raw = params.get(key)
        if raw is None:
            return default
        try:
            return cast(raw)
        except ValueError:
            raise UnknownPolicyError(f"policy {name!r}: {key}={raw!r} is not a {cast.__name__}") from None

    def on_off(key: str) -> bool:
        raw = params.get(key, "on").lower()
        if raw not in ("on", "off"):
            raise UnknownPolicyError(f"policy {name!r}: {key}={params[key]!r} must be 'on' or 'off'")
        return raw == "on"

    if name == "pd":
        return PDPolicy(models, cfg, prefix_aware=on_off("prefix"))
    if name in ("sq", "sl"):
        threshold = int(number("theta" if name == "sq" else "l", 4 if name == "sq" else 2048, int))
        chunk = int(number("chunk", 128, int))
        if threshold < 0 or chunk < 2:
            raise UnknownPolicyError(f"policy {name!r}: threshold={threshold} must be >= 0, chunk={chunk} >= 2")
        return StaticPolicy(models, cfg, name, threshold, chunk)
    if name in ("llmd", "dynamo", "aibrix"):
        chunk = int(number("chunk", defaults.DECODE_STEP_TOKENS, int))
        if chunk < 2:
            raise UnknownPolicyError(f"policy {name!r}: chunk={chunk} must be >= 2")

        def bounded(key: str, default: float, low: float, high: float) -> float:
            value = number(key, default)
            if not (low <= value <= high):  # "not" so that NaN fails too
                raise UnknownPolicyError(f"policy {name!r}: {key}={value} must be in [{low:g}, {high:g}]")
            return value

        if name == "llmd":
            threshold = int(number("threshold", 16, int))
            if threshold < 0:
                raise UnknownPolicyError(f"policy 'llmd': threshold={threshold} must be >= 0 (0: never disaggregate)")
            return LlmdPolicy(models, cfg, threshold, chunk)
        if name == "aibrix":
            return AibrixPolicy(
                models, cfg, bounded("high", 1.0, 0, math.inf), bounded("low", 0.25, 0, math.inf), chunk
            )
        mode = params.get("mode", "isl").lower()
        if mode not in DYNAMO_MODES:
            raise UnknownPolicyError(f"policy 'dynamo': mode={mode!r} must be one of {list(DYNAMO_MODES)}")
        isl = int(number("isl", 2048, int))
        if isl < 0:
            raise UnknownPolicyError(f"policy 'dynamo': isl={isl} must be >= 0")
        kv_raw = params.get("kv", "0.5").lower()
        kv = None if kv_raw == "off" else bounded("kv", 0.5, 0, 1)
        return DynamoPolicy(
            models, cfg, mode, isl, bounded("ratio", 0.7, 0, 1), bounded("busy", 4.0, 0, math.inf), kv, chunk
        )
    changes: dict[str, object] = {
        "alpha": number("alpha", cfg.alpha),
        "beta": number("beta", cfg.beta),
        "model_error": number("error", cfg.model_error),
    }
    for key, field in (
        ("guard", "node_step_guard"),
        ("overload", "decode_overload_guard"),
        ("calibrate", "calibrate"),
        ("pulls", "plan_with_pulls"),
    ):
        if key in params:
            if params[key].lower() not in ("on", "off"):
                raise UnknownPolicyError(f"policy {name!r}: {key}={params[key]!r} must be 'on' or 'off'")
            changes[field] = params[key].lower() == "on"
    if "keep" in params:
        if params["keep"].lower() not in alg.KEEP_ESTIMATES:
            raise UnknownPolicyError(
                f"policy {name!r}: keep={params['keep']!r} must be one of {list(alg.KEEP_ESTIMATES)}"
            )
        changes["keep_estimate"] = params["keep"].lower()
    for key, field in (("pressure", "decode_pressure_share"), ("gate", "deflect_gate_share")):
        if key in params:
            share = None if params[key].lower() == "off" else number(key, 0.0)
            if share is not None and not (0.0 < share <= 1.0):  # "not" so that NaN fails too
                raise UnknownPolicyError(f"policy {name!r}: {key}={params[key]!r} must be in (0, 1] or 'off'")
            changes[field] = share
    if "chunks" in params:
        changes["chunk_candidates"] = parse_chunks(name, params["chunks"])
    if name == "oracle":
        changes["max_pending_deflections"] = None  # it sees the true backlog, no limit needed
    elif "pending" in params:
        changes["max_pending_deflections"] = (
            None if params["pending"].lower() == "none" else int(number("pending", 1, int))
        )
    return KairosPolicy(
        models,
        dataclasses.replace(cfg, **changes),
        fresh_state=(name == "oracle"),
        prefix_aware=on_off("prefix"),
        slo_aware=on_off("slo"),
    )


def split_policy_list(text: str) -> list[str]:
    """Split ``"pd,kairos:alpha=1.3,beta=0.9,sq:theta=4"`` into policy specs: a ``key=value``
    item without a policy name belongs to the spec before it. ``;`` also separates specs."""
    specs: list[str] = []
    for part in (p.strip() for chunk in text.split(";") for p in chunk.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and specs:
            specs[-1] += ("," if ":" in specs[-1] else ":") + part
        else:
            specs.append(part)
    if not specs:
        raise UnknownPolicyError(f"no policy in {text!r}; known policies: {list(POLICY_NAMES)}")
    for spec in specs:
        parse_policy_spec(spec)  # fail fast, before any simulation runs
    return specs
