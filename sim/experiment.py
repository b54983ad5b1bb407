"""Simulation experiments: one run, or a sweep of policies x request rates, as records.

Every point of a sweep at one rate replays the same requests, so policies are compared side by
side on identical traffic.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from kairos.common import defaults
from kairos.common.contracts import HEARTBEAT_PERIOD_S
from kairos.core.algorithm import DEFAULT_CHUNK_CANDIDATES, DeciderConfig
from kairos.core.latency import DEFAULT_PROFILE, load_profile
from kairos.core.policies import create_policy, split_policy_list
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.requests import RequestSpec
from kairos.traffic.traces import load_trace, rescale_to_rate, truncate
from kairos.traffic.workloads import CONVERSATION_NAMES, WORKLOAD_NAMES, make_workload


@dataclass(frozen=True)
class SimSettings:
    """Everything ``kairos sim`` needs; YAML section ``sim``, env ``KAIROS_SIM_*``, flags."""

    workload: str = "bursty"  # a synthetic workload name, ignored when ``trace`` is set
    trace: str | None = None  # a trace file (own JSONL, Azure CSV, Mooncake JSONL)
    policies: str = "pd,kairos"  # comma-separated policy specs, e.g. "pd,kairos:alpha=1.3,beta=0.9"
    rps: tuple[float, ...] = (8.0,)  # request rates; a trace is rescaled to each
    duration_s: float = 1200.0  # simulated seconds of arrivals per point
    seed: int = 1
    cv: float | None = None  # inter-arrival CV; None = the workload's default
    error: float = 0.0  # ground-truth step-time error (mean absolute relative error)
    error_form: str = "iid"  # "iid" or "correlated" (a per-node bias plus per-step noise)
    error_bias_share: float = defaults.SIM_ERROR_BIAS_SHARE  # correlated: the bias's share of the variance
    calibration_quantile: float = defaults.CALIBRATION_QUANTILE  # the decode nodes' (only to measure it)
    profile: str = DEFAULT_PROFILE  # packaged profile name or profile file path
    prefill_nodes: int = 2
    decode_nodes: int = 2
    prefill_step_tokens: int = defaults.PREFILL_STEP_TOKENS
    decode_step_tokens: int = defaults.DECODE_STEP_TOKENS
    kv_capacity_tokens: int = defaults.KV_CAPACITY_TOKENS
    heartbeat_s: float = HEARTBEAT_PERIOD_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    ttft_slo_s: float = defaults.TTFT_SLO_S
    chunk_candidates: tuple[int, ...] = DEFAULT_CHUNK_CANDIDATES
    stale_after_s: float = defaults.STALE_AFTER_S
    jobs: int = 0  # parallel simulations; 0 = one per CPU core
    prefix_index: bool = False  # prefix hits from the nodes' KV events, not the caches' truth

    def __post_init__(self) -> None:
        if self.trace is None and self.workload.lower() not in (*WORKLOAD_NAMES, *CONVERSATION_NAMES):
            raise ValueError(f"unknown workload {self.workload!r}; known: {[*WORKLOAD_NAMES, *CONVERSATION_NAMES]}")
        if not self.rps or any(r <= 0 for r in self.rps):
            raise ValueError(f"rps must be a non-empty list of positive rates, got {list(self.rps)}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.jobs < 0:
            raise ValueError(f"jobs must be >= 0, got {self.jobs}")
        split_policy_list(self.policies)

    @property
    def policy_specs(self) -> list[str]:
        return split_policy_list(self.policies)

    def cluster(self) -> ClusterConfig:
        return ClusterConfig(
            prefill_nodes=self.prefill_nodes,
            decode_nodes=self.decode_nodes,
            prefill_step_tokens=self.prefill_step_tokens,
            decode_step_tokens=self.decode_step_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens,
            heartbeat_s=self.heartbeat_s,
            error=self.error,
            seed=self.seed,
            error_form=self.error_form,
            error_bias_share=self.error_bias_share,
            calibration_quantile=self.calibration_quantile,
            prefix_index=self.prefix_index,
        )

    def decider(self) -> DeciderConfig:
        return DeciderConfig(
            tbt_slo_s=self.tbt_slo_s,
            ttft_slo_s=self.ttft_slo_s,
            chunk_candidates=self.chunk_candidates,
            stale_after_s=self.stale_after_s,
        )


def requests_for(settings: SimSettings, rps: float) -> list[RequestSpec]:
    """The traffic of one sweep point."""
    if settings.trace is not None:
        return truncate(rescale_to_rate(load_trace(settings.trace), rps), settings.duration_s)
    return make_workload(settings.workload, rps=rps, duration_s=settings.duration_s, seed=settings.seed, cv=settings.cv)


def run_point(settings: SimSettings, policy_spec: str, rps: float) -> dict[str, Any]:
    """Simulate one policy at one rate; returns the result record."""
    models = load_profile(settings.profile)
    policy = create_policy(policy_spec, models, settings.decider())
    requests = requests_for(settings, rps)
    started = time.perf_counter()
    metrics = Simulator(requests, policy, models, settings.cluster(), settings.tbt_slo_s, settings.ttft_slo_s).run()
    wall = time.perf_counter() - started
    return {
        "policy": policy.label,
        "policy_spec": policy_spec,
        "rps": rps,
        "workload": settings.trace or settings.workload,
        "duration_s": settings.duration_s,
        "seed": settings.seed,
        "error": settings.error,
        # The correlated form's records say so; an i.i.d. run's record stays as it was before the option.
        **({"error_form": settings.error_form} if settings.error_form != "iid" else {}),
        "profile": models.name,
        "topology": f"{settings.prefill_nodes}P{settings.decode_nodes}D",
        "tbt_slo_ms": settings.tbt_slo_s * 1e3,
        "ttft_slo_s": settings.ttft_slo_s,
        **metrics.summary,
        "wall_s": wall,
        "sim_requests_per_wall_s": len(requests) / wall if wall > 0 else 0.0,
    }


def run_sweep(
    settings: SimSettings, progress: Callable[[int, int, dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Every policy at every rate, in parallel processes; records come back in (rate, policy)
    order whatever order they finish in."""
    points = [(spec, rps) for rps in settings.rps for spec in settings.policy_specs]
    jobs = min(settings.jobs or os.cpu_count() or 1, len(points))
    results: dict[int, dict[str, Any]] = {}
    if jobs == 1:
        for i, (spec, rps) in enumerate(points):
            results[i] = run_point(settings, spec, rps)
            if progress:
                progress(len(results), len(points), results[i])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_point, settings, spec, rps): i for i, (spec, rps) in enumerate(points)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(len(results), len(points), results[futures[fut]])
    return [results[i] for i in range(len(points))]


def print_progress(done: int, total: int, record: dict[str, Any]) -> None:
    print(
        f"[{done}/{total}] {record['policy']} @ {record['rps']:g} rps: "
        f"P95 TTFT {record['p95_ttft_s']:.2f} s, {record['deflections']} deflections "
        f"({record['wall_s']:.1f} s wall)",
        file=sys.stderr,
        flush=True,
    )
