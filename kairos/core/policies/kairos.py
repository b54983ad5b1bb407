"""``kairos`` and ``oracle``: Algorithm 1, on the heartbeats or (the Oracle, simulator only) on
the true state. Their parameters set the decider's; the rest comes from the base config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from kairos.common import defaults
from kairos.core import algorithm as alg
from kairos.core.decision import Decision
from kairos.core.latency import LatencyModels
from kairos.core.policies.registry import parse_policy_spec, register
from kairos.core.policies.spec import PolicySpec, format_chunks
from kairos.core.slo import RequestSLO
from kairos.core.state import ClusterView


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
        split = "" if self.config.split == defaults.SPLIT else f",split={self.config.split}"
        knobs = f"{pending}{guard}{overload}{pressure}{gate}{error}{calibrate}{pulls}{keep}{split}{prefix}{chunks}"
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


def _share_label(share: float | None) -> str:
    return "off" if share is None else f"{share:g}"


# Algorithm 1's parameters, the Kairos policy's and the Oracle's, and what their values look like.
DECIDER_PARAMS: dict[str, str] = {
    "alpha": "A",
    "beta": "B",
    "guard": "off",
    "overload": "off",
    "pressure": "S|off",
    "gate": "S|off",
    "error": "E",
    "calibrate": "off",
    "keep": "|".join(alg.KEEP_ESTIMATES),
    "split": "|".join(alg.SPLIT_CHOICES),
    "prefix": "off",
    "chunks": "2048/1024/...",
    "pulls": "off",
    "slo": "off",
}
# Switches on the decider: spec parameter -> DeciderConfig field.
_SWITCHES = (
    ("guard", "node_step_guard"),
    ("overload", "decode_overload_guard"),
    ("calibrate", "calibrate"),
    ("pulls", "plan_with_pulls"),
)
_SHARES = (("pressure", "decode_pressure_share"), ("gate", "deflect_gate_share"))
# Every parameter that sets a DeciderConfig field, and the field: the dispatcher takes those as its
# own settings, one way each, and refuses them in its policy spec (the simulator compares specs).
DECIDER_FIELDS: dict[str, str] = {
    "alpha": "alpha",
    "beta": "beta",
    "error": "model_error",
    "keep": "keep_estimate",
    "split": "split",
    "chunks": "chunk_candidates",
    "pending": "max_pending_deflections",
    **dict(_SWITCHES),
    **dict(_SHARES),
}


def decider_changes(spec: PolicySpec, base: alg.DeciderConfig, *, oracle: bool = False) -> dict[str, object]:
    """The DeciderConfig fields ``spec``'s parameters set (every one checked), by field name."""
    changes: dict[str, object] = {
        "alpha": spec.number("alpha", base.alpha),
        "beta": spec.number("beta", base.beta),
        "model_error": spec.number("error", base.model_error),
    }
    for key, field in _SWITCHES:
        if key in spec:
            changes[field] = spec.on_off(key)
    if "keep" in spec:
        keep = spec.params["keep"]
        if keep.lower() not in alg.KEEP_ESTIMATES:
            raise spec.error(f"keep={keep!r} must be one of {list(alg.KEEP_ESTIMATES)}")
        changes["keep_estimate"] = keep.lower()
    if "split" in spec:
        split = spec.params["split"].lower()
        if split not in alg.SPLIT_CHOICES:
            raise spec.error(f"split={spec.params['split']!r} must be one of {list(alg.SPLIT_CHOICES)}")
        changes["split"] = split
    for key, field in _SHARES:
        if key in spec:
            share = None if spec.params[key].lower() == "off" else spec.value(key)
            if share is not None and not (0.0 < share <= 1.0):  # "not" so that NaN fails too
                raise spec.error(f"{key}={spec.params[key]!r} must be in (0, 1] or 'off'")
            changes[field] = share
    if "chunks" in spec:
        changes["chunk_candidates"] = spec.chunks()
    if oracle:
        changes["max_pending_deflections"] = None  # it sees the true backlog, no limit needed
    elif "pending" in spec:
        pending = spec.params["pending"]
        changes["max_pending_deflections"] = None if pending.lower() == "none" else spec.value("pending", int)
    return changes


def build(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig, *, oracle: bool) -> KairosPolicy:
    return KairosPolicy(
        models,
        dataclasses.replace(base, **decider_changes(spec, base, oracle=oracle)),
        fresh_state=oracle,
        prefix_aware=spec.on_off("prefix"),
        slo_aware=spec.on_off("slo"),
    )


def gateway_form(spec: PolicySpec) -> tuple[str, dict[str, object]]:
    """A simulator's ``kairos`` spec as a gateway takes it: the spec less its decider parameters,
    and those as the DeciderConfig settings they set (``kairos:alpha=1.3,prefix=off`` ->
    ``("kairos:prefix=off", {"alpha": 1.3})``), for a live benchmark that runs a spec's variant."""
    base = alg.DeciderConfig()
    changes = {k: v for k, v in decider_changes(spec, base).items() if v != getattr(base, k) or k in _given(spec)}
    rest = ",".join(f"{k}={v}" for k, v in spec.params.items() if k not in DECIDER_FIELDS)
    return (f"{spec.name}:{rest}" if rest else spec.name), changes


def _given(spec: PolicySpec) -> set[str]:
    return {DECIDER_FIELDS[k] for k in spec.params if k in DECIDER_FIELDS}


def gateway_settings(spec: str) -> tuple[str, dict[str, object]]:
    """:func:`gateway_form` of a spec's text; any policy but ``kairos`` is its own gateway form."""
    name, params = parse_policy_spec(spec)
    return gateway_form(PolicySpec(name, params)) if name == "kairos" else (spec, {})


register("kairos", partial(build, oracle=False), {"pending": "N|none", **DECIDER_PARAMS})
# The Oracle sees the true backlog: no pending limit to set.
register("oracle", partial(build, oracle=True), DECIDER_PARAMS, simulator_only=True)
