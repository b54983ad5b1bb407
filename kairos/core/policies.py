"""Routing policies: the Kairos decision and the baselines it is compared with.

Every policy maps (prompt tokens, cluster view, now) to a :class:`Decision`. Build one from a
spec string such as ``kairos:alpha=1.3,beta=0.9`` with :func:`make_policy`, which raises on
unknown names and parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from kairos.common.errors import UnknownPolicyError
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels
from kairos.core.state import ClusterView


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


def _keep(
    models: LatencyModels, cfg: alg.DeciderConfig, prompt_tokens: int, view: ClusterView, now: float, reason: Reason
) -> Decision:
    prefill, ttft_pf = alg.best_prefill_node(models, view, now, cfg, prompt_tokens)
    decode = alg.pick_keep_decode_node(models, view, now, cfg, prompt_tokens)
    return Decision(Route.KEEP, reason, decode.node_id, prefill.node_id, (), ttft_pf, None, prompt_tokens)


@dataclass(frozen=True)
class PDPolicy:
    """Plain P/D disaggregation: never deflect."""

    models: LatencyModels
    config: alg.DeciderConfig
    label: str = "pd"
    fresh_state: bool = False

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        alg.validate_prompt(prompt_tokens)
        return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_POLICY)


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
        fresh = [
            n
            for n in view.decode
            if alg.is_fresh(n.reported_at, now, self.config)
            and n.free_kv_tokens >= prompt_tokens
            and n.decode_tokens < self.chunk_tokens
        ]
        if not fresh:
            return _keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_NO_ELIGIBLE_DECODE)
        node = min(fresh, key=lambda n: (alg.decode_load_s(self.models, n), n.node_id))
        b, k = node.decode_tokens, node.kv_tokens
        sizes: list[int] = []
        times: list[float] = []
        cached = 0
        while cached < prompt_tokens:
            p = min(self.chunk_tokens - b, prompt_tokens - cached)
            sizes.append(p)
            times.append(self.models.mixed_step_s(b + p, cached, b, k + cached))
            cached += p
        _, ttft_pf = alg.best_prefill_node(self.models, view, now, self.config, prompt_tokens)
        return Decision(
            Route.DEFLECT,
            Reason.DEFLECT_STATIC_RULE,
            node.node_id,
            None,
            tuple(sizes),
            ttft_pf,
            sum(times),
            prompt_tokens,
            predicted_step_s=tuple(times),
            planned_decode_tokens=b,
        )


@dataclass(frozen=True)
class KairosPolicy:
    """Algorithm 1. As the Oracle (§3.4) it is the same decision fed the simulator's true state."""

    models: LatencyModels
    config: alg.DeciderConfig
    fresh_state: bool = False

    @property
    def label(self) -> str:
        name = "oracle" if self.fresh_state else "kairos"
        guard = "" if self.config.node_step_guard else ",guard=off"
        pending = "" if self.config.max_pending_deflections == 1 or self.fresh_state else ",pending=none"
        return f"{name}(alpha={self.config.alpha:g},beta={self.config.beta:g}{pending}{guard})"

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        return alg.decide(prompt_tokens, view, now, self.models, self.config)


@dataclass(frozen=True)
class NoPrefillPoolPolicy:
    """The gateway's degraded mode, not a routing policy to compare: with no prefill node
    registered, a decode node prefills the request itself (see
    :func:`kairos.core.algorithm.decide_without_prefill_pool`)."""

    models: LatencyModels
    config: alg.DeciderConfig
    label: str = "no-prefill-pool"
    fresh_state: bool = False

    def applies(self, view: ClusterView, now: float) -> bool:
        """No fresh prefill node, and a fresh decode node to prefill instead."""
        fresh = lambda nodes: any(alg.is_fresh(n.reported_at, now, self.config) for n in nodes)  # noqa: E731
        return not fresh(view.prefill) and fresh(view.decode)

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        return alg.decide_without_prefill_pool(prompt_tokens, view, now, self.models, self.config)


POLICY_NAMES = ("pd", "sq", "sl", "kairos", "oracle")
_PARAMS: dict[str, tuple[str, ...]] = {
    "pd": (),
    "sq": ("theta", "chunk"),
    "sl": ("l", "chunk"),
    "kairos": ("alpha", "beta", "pending", "guard"),
    "oracle": ("alpha", "beta", "guard"),
}


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


def make_policy(spec: str, models: LatencyModels, base: alg.DeciderConfig | None = None) -> Policy:
    """Build a policy from a spec string; ``base`` supplies the SLOs and chunk candidates."""
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

    if name == "pd":
        return PDPolicy(models, cfg)
    if name in ("sq", "sl"):
        threshold = int(number("theta" if name == "sq" else "l", 4 if name == "sq" else 2048, int))
        chunk = int(number("chunk", 128, int))
        if threshold < 0 or chunk < 2:
            raise UnknownPolicyError(f"policy {name!r}: threshold={threshold} must be >= 0, chunk={chunk} >= 2")
        return StaticPolicy(models, cfg, name, threshold, chunk)
    changes: dict[str, object] = {"alpha": number("alpha", cfg.alpha), "beta": number("beta", cfg.beta)}
    if "guard" in params:
        if params["guard"].lower() not in ("on", "off"):
            raise UnknownPolicyError(f"policy {name!r}: guard={params['guard']!r} must be 'on' or 'off'")
        changes["node_step_guard"] = params["guard"].lower() == "on"
    if name == "oracle":
        changes["max_pending_deflections"] = None  # it sees the true backlog, no limit needed
    elif "pending" in params:
        changes["max_pending_deflections"] = (
            None if params["pending"].lower() == "none" else int(number("pending", 1, int))
        )
    return KairosPolicy(models, dataclasses.replace(cfg, **changes), fresh_state=(name == "oracle"))


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
