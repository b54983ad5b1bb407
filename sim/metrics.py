"""Per-request and per-step measurements of a simulation, and their summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kairos.core.decision import Route
from kairos.core.slo import DEFAULT_CLASSES, SloClass, classify, meets_slo
from kairos.sim.engine import Sequence, StepPlan
from kairos.traffic.requests import RequestSpec


@dataclass(slots=True, eq=False)
class RequestRecord:
    """The life of one request; times in seconds since the run started."""

    spec: RequestSpec
    route: Route
    decode_node: str
    prefill_node: str | None
    predicted_ttft_s: float | None  # the dispatcher's prediction for the path it chose
    seq: Sequence | None = None  # the engine sequence on the decode node (or prefill, until transfer)
    prefill_seq: Sequence | None = None  # the prefill hop's sequence (keep path)
    prefill_start: float | None = None  # first prefill chunk starts
    prefill_end: float | None = None  # last prefill chunk ends
    transfer_start: float | None = None  # KV transfer starts (link free and decode KV reserved)
    transfer_end: float | None = None
    first_token: float | None = None  # first output token leaves the decode node
    first_token_step: int = -1  # decode-node step that produced it
    finished: float | None = None
    last_step: int = -1  # decode-node step that produced the last token
    cached_tokens: int = 0  # prompt tokens the node that prefilled it had cached (prefix cache)
    transfer_tokens: int = 0  # keep path: prompt tokens moved to the decode node (those it lacked)
    tpot_slo_s: float | None = None  # the TPOT SLO its decode node was told (its own, or the run's)
    # A split: k, the prompt's tokens the prefill node computed, and the decode node's schedule of
    # the rest with its step budget (the decision's, carried to the transfer's end).
    split_tokens: int = 0
    schedule: tuple[int, ...] = ()
    step_budget_s: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.spec.arrival_s

    def ttft_parts(self) -> tuple[float, float, float, float]:
        """(prefill queue, prefill execution, KV transfer incl. its queueing, decode queue); a
        split's prefill is its prefill node's part, its decode queue the rest's prefill there too."""
        assert self.prefill_start is not None and self.prefill_end is not None and self.first_token is not None
        queue = self.prefill_start - self.spec.arrival_s
        execution = self.prefill_end - self.prefill_start
        if self.route is Route.DEFLECT:
            return queue, execution, 0.0, 0.0
        assert self.transfer_end is not None
        return queue, execution, self.transfer_end - self.prefill_end, self.first_token - self.transfer_end


@dataclass
class _NodeSteps:
    durations: list[float] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)  # decodes that had a previous token (TBT samples)
    violations_before: list[int] = field(default_factory=lambda: [0])  # prefix counts of steps > tau
    # The same for each other TPOT SLO a request of the run holds (SimMetrics.request_tbt_slos)
    over: dict[float, list[int]] = field(default_factory=dict)


@dataclass
class SimMetrics:
    """Raw measurements; ``summary`` is filled in at the end of a run."""

    decode_nodes: list[str]
    tbt_slo_s: float
    # The requests' own TPOT SLOs other than tbt_slo_s: each request's TBT is judged by its own.
    request_tbt_slos: tuple[float, ...] = ()
    deflections: int = 0
    splits: int = 0
    # Decode steps (with TBT samples) that carried a deflected prefill's chunk, and how many of them
    # went over tau: the probability the node's step calibration keeps under 1%. Not in the summary
    # (its records stay as they were); bench/sim/calibration.py reads them.
    deflect_steps: int = 0
    deflect_steps_over_tau: int = 0
    steps: dict[str, _NodeSteps] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.steps = {n: _NodeSteps() for n in self.decode_nodes}
        taus = tuple(t for t in dict.fromkeys(self.request_tbt_slos) if t != self.tbt_slo_s)
        for s in self.steps.values():
            s.over = {t: [0] for t in taus}

    def record_decode_step(self, node_id: str, plan: StepPlan, duration: float) -> None:
        s = self.steps[node_id]
        s.durations.append(duration)
        s.decodes.append(plan.decode_tokens - plan.new_decoders)
        s.violations_before.append(s.violations_before[-1] + (duration > self.tbt_slo_s))
        for tau, counts in s.over.items():
            counts.append(counts[-1] + (duration > tau))
        if plan.chunks and plan.decode_tokens > plan.new_decoders and any(c.seq.schedule for c in plan.chunks):
            self.deflect_steps += 1
            self.deflect_steps_over_tau += duration > self.tbt_slo_s

    def request_tbt_violations(self, rec: RequestRecord, tau_s: float | None = None) -> tuple[int, int]:
        """(steps over tau, TBT samples) for one request: it was in every step of its decode
        node between its first and its last token. ``tau_s``: its own TPOT SLO (one of
        ``request_tbt_slos``), else the run's."""
        if rec.last_step <= rec.first_token_step:
            return 0, 0
        steps = self.steps[rec.decode_node]
        prefix = steps.violations_before if tau_s is None or tau_s == self.tbt_slo_s else steps.over[tau_s]
        return prefix[rec.last_step + 1] - prefix[rec.first_token_step + 1], rec.last_step - rec.first_token_step


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """Percentiles of ``values`` where each value counts ``weights`` times."""
    if values.size == 0 or weights.sum() == 0:
        return [0.0 for _ in qs]
    order = np.argsort(values)
    v, w = values[order], np.cumsum(weights[order])
    return [float(v[min(np.searchsorted(w, q / 100 * w[-1]), v.size - 1)]) for q in qs]


def summarize(
    records: list[RequestRecord],
    metrics: SimMetrics,
    tbt_slo_s: float,
    ttft_slo_s: float,
    classes: tuple[SloClass, ...] = DEFAULT_CLASSES,
) -> dict[str, Any]:
    """The figures a run reports (times in seconds unless the key says ms). Each request meets
    its SLOs, its own where it carries them (``RequestSpec.ttft_slo_s`` / ``tpot_slo_s``), else
    the run's; when any request carries its own, ``per_class`` has attainment and goodput by the
    class its SLO pair falls in (``kairos.core.slo.classify`` over ``classes``)."""
    metrics.records = records
    ttft = np.array([r.ttft for r in records])
    parts = np.array([r.ttft_parts() for r in records]) if records else np.zeros((0, 4))
    deflected = np.array([r.route is Route.DEFLECT for r in records], dtype=bool)
    split = np.array([r.route is Route.SPLIT for r in records], dtype=bool)
    kept = ~deflected & ~split
    durations = np.concatenate([np.asarray(s.durations) for s in metrics.steps.values()] or [np.zeros(0)])
    weights = np.concatenate([np.asarray(s.decodes) for s in metrics.steps.values()] or [np.zeros(0)])
    decode_steps = weights > 0
    tbt50, tbt95, tbt99 = weighted_percentiles(durations, weights, (50, 95, 99))
    met = np.zeros(len(records), dtype=bool)
    for i, (r, t) in enumerate(zip(records, ttft, strict=True)):
        own_ttft = ttft_slo_s if r.spec.ttft_slo_s is None else r.spec.ttft_slo_s
        bad, samples = metrics.request_tbt_violations(r, r.spec.tpot_slo_s)
        met[i] = meets_slo(t, own_ttft, bad, samples)  # the request's own P95 TBT <= its tau
    meets = int(met.sum())
    start = min((r.spec.arrival_s for r in records), default=0.0)
    end = max((r.finished or 0.0 for r in records), default=0.0)
    span = max(end - start, 1e-9)
    out_tokens = sum(r.spec.output_tokens for r in records)
    all_tokens = out_tokens + sum(r.spec.prompt_tokens for r in records)

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if a.size else 0.0

    predicted = np.array([np.nan if r.predicted_ttft_s is None else r.predicted_ttft_s for r in records])
    ok = ~np.isnan(predicted) & (ttft > 0)
    later = np.array([r.spec.turn >= 2 for r in records], dtype=bool)
    prompts = np.array([r.spec.prompt_tokens for r in records], dtype=np.int64)
    cached = np.array([r.cached_tokens for r in records], dtype=np.int64)
    # A decode node's share of a prompt it neither computed nor received: its own cache's hit.
    on_prefill = np.array([r.split_tokens or r.spec.prompt_tokens for r in records], dtype=np.int64)
    transferred = np.array([r.transfer_tokens for r in records], dtype=np.int64)
    decode_hit = np.where(deflected, cached, on_prefill - transferred)
    kept_prompt = on_prefill[~deflected].sum()
    return {
        "requests": len(records),
        "deflections": int(deflected.sum()),
        "splits": int(split.sum()),
        # the prompt tokens the decode nodes prefilled: deflections' uncached and splits' rests
        "decode_prefill_tokens": int((prompts - cached)[deflected].sum() + (prompts - on_prefill)[split].sum()),
        "p50_ttft_s": pct(ttft, 50),
        "p95_ttft_s": pct(ttft, 95),
        "p99_ttft_s": pct(ttft, 99),
        "p95_ttft_keep_s": pct(ttft[kept], 95),
        "p95_ttft_deflect_s": pct(ttft[deflected], 95),
        "p95_ttft_split_s": pct(ttft[split], 95),
        "p95_prefill_queue_s": pct(parts[kept, 0], 95),
        "p95_prefill_exec_s": pct(parts[kept, 1], 95),
        "p95_kv_transfer_s": pct(parts[kept, 2], 95),
        "p95_decode_queue_s": pct(parts[kept, 3], 95),
        "p50_tbt_ms": tbt50 * 1e3,
        "p95_tbt_ms": tbt95 * 1e3,
        "p99_tbt_ms": tbt99 * 1e3,
        "max_tbt_ms": float(durations[decode_steps].max() * 1e3) if decode_steps.any() else 0.0,
        "tbt_violation_rate": float((durations[decode_steps] > tbt_slo_s).mean()) if decode_steps.any() else 0.0,
        "slo_attainment": meets / len(records) if records else 0.0,
        "output_tokens_per_s": out_tokens / span,
        "total_tokens_per_s": all_tokens / span,
        "ttft_prediction_mape": _mape(predicted, ttft, ok),
        # per path: the keep path's estimate (Eq. 1 and the KV hand-off) and the deflect path's (Eq. 6)
        "ttft_prediction_mape_keep": _mape(predicted, ttft, ok & kept),
        "ttft_prediction_mape_deflect": _mape(predicted, ttft, ok & deflected),
        "ttft_prediction_mape_split": _mape(predicted, ttft, ok & split),
        # signed mean of (predicted - observed) / observed on the keep path: < 0 under-predicts
        "ttft_prediction_bias_keep": _mape(predicted, ttft, ok & kept, signed=True),
        # Conversations and prefix caching (0 where the run has no later turns or no hashes)
        "p95_ttft_turn2plus_s": pct(ttft[later], 95),
        "prefix_hit_rate_prefill": float(cached[~deflected].sum() / kept_prompt) if kept_prompt else 0.0,
        "prefix_hit_rate_decode": float(decode_hit.sum() / prompts.sum()) if records else 0.0,
    } | _per_class(records, met, ttft, span, tbt_slo_s, ttft_slo_s, classes)


def _per_class(
    records: list[RequestRecord],
    met: np.ndarray,
    ttft: np.ndarray,
    span: float,
    tbt_slo_s: float,
    ttft_slo_s: float,
    classes: tuple[SloClass, ...],
) -> dict[str, Any]:
    """``{"per_class": {name: figures}}`` when a request carries SLOs of its own, else nothing.
    Goodput: the requests that met their SLOs, per second of the run, and their output tokens."""
    if not any(r.spec.ttft_slo_s is not None or r.spec.tpot_slo_s is not None for r in records):
        return {}
    names = np.array(
        [
            classify(
                ttft_slo_s if r.spec.ttft_slo_s is None else r.spec.ttft_slo_s,
                tbt_slo_s if r.spec.tpot_slo_s is None else r.spec.tpot_slo_s,
                classes,
            )
            for r in records
        ]
    )
    outputs = np.array([r.spec.output_tokens for r in records], dtype=np.int64)
    deflected = np.array([r.route is Route.DEFLECT for r in records], dtype=bool)
    return {"per_class": per_class_figures(names, met, outputs, deflected, ttft, span, classes)}


def per_class_figures(
    names: np.ndarray,
    met: np.ndarray,
    output_tokens: np.ndarray,
    deflected: np.ndarray,
    ttft_s: np.ndarray,
    span_s: float,
    classes: tuple[SloClass, ...],
) -> dict[str, dict[str, Any]]:
    """Attainment and goodput by SLO class, one entry per class (in ``classes``' order) that has
    requests: the one definition the simulator and ``kairos replay`` report. Per request (arrays
    of one length): its class name, whether it met its own SLOs, its output tokens, whether it was
    deflected and its TTFT (NaN: it got no first token; left out of the percentile, None when no
    request of the class has one). Goodput: the requests that met their SLOs per second of
    ``span_s``, and their output tokens per second."""
    out: dict[str, dict[str, Any]] = {}
    for k in classes:
        mine = names == k.name
        n = int(mine.sum())
        if not n:
            continue
        ttft = ttft_s[mine]
        ttft = ttft[~np.isnan(ttft)]
        out[k.name] = {
            "requests": n,
            "slo_attainment": float(met[mine].mean()),
            "goodput_rps": float(met[mine].sum() / span_s),
            "goodput_tokens_per_s": float(output_tokens[mine & met].sum() / span_s),
            "p95_ttft_s": float(np.percentile(ttft, 95)) if ttft.size else None,
            "deflections": int(deflected[mine].sum()),
        }
    return out


def _mape(predicted: np.ndarray, observed: np.ndarray, mask: np.ndarray, signed: bool = False) -> float:
    """Mean (absolute, unless ``signed``) relative error of the predictions where ``mask``; 0 for none."""
    if not mask.any():
        return 0.0
    err = (predicted[mask] - observed[mask]) / observed[mask]
    return float(np.mean(err if signed else np.abs(err)))
