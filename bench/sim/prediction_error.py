"""The dispatcher's TTFT predictions against the simulator with the ground truth equal to the
model (no step error), per path, with the error taken apart by where it comes from (issue 32).

    python -m bench.sim.prediction_error [--workload bursty] [--rps 3,4,5,6,7,8] [--duration 1200]
                                         [--seed 90417] [--policy kairos] [--stride 1]
                                         [--json PATH] [--before PATH]

With truth = model, a prediction misses only because its inputs are not the truth at the time
it is made or the world changes after it. For every ``--stride``-th request the script keeps,
beside the decision's own prediction (``pred``) and the simulated TTFT (``obs``):

- ``fresh``: the same path's estimate (the same prefill and decode node, or the same decode
  node's schedule) on heartbeats taken at the decision's instant (the view's overlay of what no
  heartbeat shows, incoming keeps, kept): pred - fresh is the **heartbeat age**;
- ``frozen``: the request's TTFT in a copy of the simulation forked at its decision and run with
  no arrival after it: obs - frozen is what **arrivals after the decision** did to it, and
  fresh - frozen is the **estimator's own** error, with exact inputs and no later arrival.

Per rate and path it prints the MAPE (pred vs obs), the MAPE against the frozen truth (what is
left without later arrivals) and against it from fresh heartbeats (the estimator alone), the mean
of |obs - frozen| / obs (arrivals after) and of |pred - fresh| / obs (heartbeat age), and the
signed bias. For the keep path the estimator's error is split further into its prefill part
(Eq. 1 against the frozen prefill end) and its hand-off (transfer, link and admission waits,
join). ``--before`` prints an earlier JSON's rows beside these (the same script run on an
earlier tree: put that tree's packages first, as bench/sim/keep_estimate.py says).

Points run one after another in this process (the machine is shared).
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.results import RESULTS_DIR
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Route
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.policies import create_policy
from kairos.core.state import ClusterView
from kairos.sim import simulator as simmod
from kairos.sim.experiment import SimSettings, requests_for
from kairos.sim.metrics import RequestRecord, SimMetrics
from kairos.traffic.requests import RequestSpec


@dataclass
class Probe:
    """What one request's decision predicted, and the truths it is held against."""

    route: Route
    pred: float  # the decision's prediction for its path
    fresh: float  # the same path's estimate on heartbeats taken at the decision
    frozen: float = math.nan  # its TTFT with no arrival after its decision
    frozen_prefill_end: float = math.nan  # keep: its prefill's end then, from its arrival
    pred_prefill_end: float = math.nan  # keep: Eq. 1 as decided
    fresh_prefill_end: float = math.nan  # keep: Eq. 1 on fresh heartbeats
    rec: RequestRecord | None = field(default=None, repr=False)


def _node(nodes: tuple[Any, ...], node_id: str | None) -> Any:
    return next(n for n in nodes if n.node_id == node_id)


def path_estimate(
    models: LatencyModels, config: alg.DeciderConfig, view: ClusterView, d: Decision, now: float
) -> tuple[float, float]:
    """The TTFT estimate of ``d``'s path on ``view`` (and, for a keep, its prefill part), as the
    tree being measured computes it (a tree from before issue 32 has Eq. 1 and no clock there)."""
    decode = _node(view.decode, d.decode_node)
    if d.route is Route.KEEP:
        prefill = _node(view.prefill, d.prefill_node)
        keep_prefill_s = getattr(alg, "keep_prefill_s", None)
        if keep_prefill_s is None:
            prefill_s = alg.prefill_ttft_s(models, prefill, d.prompt_tokens)
            return alg.keep_ttft_s(models, config, prefill_s, decode, d.prompt_tokens), prefill_s
        prefill_s = keep_prefill_s(models, config, prefill, d.prompt_tokens, 0, now)
        return alg.keep_ttft_s(models, config, prefill_s, decode, d.prompt_tokens, 0, now), prefill_s
    plan = alg.plan_on_decode_node(models, config, decode, d.prompt_tokens, math.inf, 0, now)
    return (math.nan if isinstance(plan, str) else plan.ttft_s), math.nan


class ProbedSimulator(simmod.Simulator):
    """The simulator, with each sampled decision held against a fresh view and a frozen fork."""

    def __init__(self, *args: Any, config: alg.DeciderConfig, stride: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = config
        self.stride = stride
        self.probes: list[Probe] = []
        self.last_decision: Decision | None = None
        self.policy = _Recording(self.policy, self)

    def _fresh_tracker_view(self, now: float) -> ClusterView:
        tracker = copy.deepcopy(self.tracker)
        for e in self.prefill:
            tracker.update_prefill(simmod._prefill_state(e, now))
        for e in self.decode:
            tracker.update_decode(simmod._decode_state(e.snapshot(now), now, self.links[e.config.node_id]))
        return tracker.view()

    def _on_arrival(self, now: float, spec: RequestSpec) -> None:
        sampled = (self._arrived % self.stride) == 0
        fresh_view = self._fresh_tracker_view(now) if sampled else None
        super()._on_arrival(now, spec)
        if not sampled:
            return
        d, rec = self.last_decision, self._records[-1]
        assert d is not None and fresh_view is not None
        fresh, fresh_pf = path_estimate(self.models, self.config, fresh_view, d, now)
        probe = Probe(d.route, rec.predicted_ttft_s or math.nan, fresh, rec=rec)
        if d.route is Route.KEEP:
            probe.pred_prefill_end = d.predicted_prefill_end_s or math.nan
            probe.fresh_prefill_end = fresh_pf
        probe.frozen, probe.frozen_prefill_end = self._frozen(rec, spec)
        self.probes.append(probe)

    def _frozen(self, rec: RequestRecord, spec: RequestSpec) -> tuple[float, float]:
        """``rec``'s TTFT (and prefill end) in a copy of the run that no request enters after it."""
        memo: dict[int, Any] = {}
        fork = copy.copy(self)
        for name in ("engines", "links", "_events", "_inflight"):
            setattr(fork, name, copy.deepcopy(getattr(self, name), memo))
        fork.prefill = [fork.engines[e.config.node_id] for e in self.prefill]
        fork.decode = [fork.engines[e.config.node_id] for e in self.decode]
        fork.metrics = SimMetrics(decode_nodes=[e.config.node_id for e in self.decode], tbt_slo_s=self.tbt_slo_s)
        fork._records, fork._waiting_for, fork.prefix_index = [], {}, None
        fork._arrived = len(self.requests)  # heartbeats read by no one: skipped
        mine: RequestRecord = memo[id(rec)]
        handlers: dict[int, Callable[[float, Any], Any]] = {
            simmod._STEP_END: fork._on_step_end,
            simmod._TRANSFER_END: fork._on_transfer_end,
        }
        events = fork._events
        while mine.first_token is None:
            if not events:
                return math.nan, math.nan
            t, kind, _, payload = heapq.heappop(events)
            handler = handlers.get(kind)
            if handler is not None:
                handler(t, payload)
        end = math.nan if mine.prefill_end is None else mine.prefill_end - spec.arrival_s
        return mine.first_token - spec.arrival_s, end


class _Recording:
    """The policy, keeping its last decision for the probe."""

    def __init__(self, policy: Any, sim: ProbedSimulator) -> None:
        self._policy, self._sim = policy, sim
        self.label, self.fresh_state = policy.label, policy.fresh_state
        self.prefix_aware = getattr(policy, "prefix_aware", False)

    def decide(self, *args: Any, **kwargs: Any) -> Decision:
        self._sim.last_decision = self._policy.decide(*args, **kwargs)
        return self._sim.last_decision


def _mean_abs_rel(a: np.ndarray, b: np.ndarray, over: np.ndarray) -> float | None:
    ok = ~(np.isnan(a) | np.isnan(b) | np.isnan(over))
    return float(np.mean(np.abs(a[ok] - b[ok]) / over[ok])) if ok.any() else None


def _mean_rel(a: np.ndarray, b: np.ndarray, over: np.ndarray) -> float | None:
    ok = ~(np.isnan(a) | np.isnan(b) | np.isnan(over))
    return float(np.mean((a[ok] - b[ok]) / over[ok])) if ok.any() else None


def summarize_path(probes: list[Probe]) -> dict[str, Any]:
    pred = np.array([p.pred for p in probes])
    obs = np.array([p.rec.ttft if p.rec is not None else math.nan for p in probes])
    fresh = np.array([p.fresh for p in probes])
    frozen = np.array([p.frozen for p in probes])
    out: dict[str, Any] = {
        "n": len(probes),
        "mape": _mean_abs_rel(pred, obs, obs),
        "bias": _mean_rel(pred, obs, obs),
        "mape_vs_frozen": _mean_abs_rel(pred, frozen, frozen),
        "mape_fresh_vs_frozen": _mean_abs_rel(fresh, frozen, frozen),
        "bias_fresh_vs_frozen": _mean_rel(fresh, frozen, frozen),
        "arrivals_after": _mean_abs_rel(obs, frozen, obs),
        "bias_arrivals_after": _mean_rel(frozen, obs, obs),
        "heartbeat_age": _mean_abs_rel(pred, fresh, obs),
        "bias_heartbeat_age": _mean_rel(pred, fresh, obs),
        "mean_obs_s": float(np.nanmean(obs)) if probes else None,
    }
    if probes and probes[0].route is Route.KEEP:
        pe = np.array([p.fresh_prefill_end for p in probes])
        fe = np.array([p.frozen_prefill_end for p in probes])
        out["estimator_prefill"] = _mean_abs_rel(pe, fe, frozen)
        out["estimator_handoff"] = _mean_abs_rel(fresh - pe, frozen - fe, frozen)
        out["bias_estimator_prefill"] = _mean_rel(pe, fe, frozen)
        out["bias_estimator_handoff"] = _mean_rel(fresh - pe, frozen - fe, frozen)
    return out


def run(settings: SimSettings, spec: str, rps: float, stride: int) -> dict[str, Any]:
    models = load_profile(settings.profile)
    config = settings.decider()
    policy = create_policy(spec, models, config)
    started = time.perf_counter()
    sim = ProbedSimulator(
        requests_for(settings, rps), policy, models, settings.cluster(), config=policy.config, stride=stride
    )
    metrics = sim.run()
    wall = time.perf_counter() - started
    keep = [p for p in sim.probes if p.route is Route.KEEP and not math.isnan(p.pred)]
    deflect = [p for p in sim.probes if p.route is Route.DEFLECT and not math.isnan(p.pred)]
    s = metrics.summary
    return {
        "policy": policy.label,
        "policy_spec": spec,
        "rps": rps,
        "requests": s["requests"],
        "deflections": s["deflections"],
        "p95_ttft_s": s["p95_ttft_s"],
        "slo_attainment": s["slo_attainment"],
        "keep": summarize_path(keep),
        "deflect": summarize_path(deflect),
        "wall_s": wall,
    }


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


HEADER = (
    f"{'':7}{'rps':>4} {'path':<8}{'n':>6} {'MAPE':>6} {'bias':>7} {'vs frozen':>9} {'estimator':>9} "
    f"{'(prefill':>8} {'handoff)':>8} {'arrivals':>8} {'hb age':>7} {'defl':>5} {'P95':>6} {'attain':>7}"
)


def row(tag: str, rec: dict[str, Any], path: str) -> str:
    p = rec[path]
    return (
        f"{tag:7}{rec['rps']:>4g} {path:<8}{p['n']:>6} {_f(p['mape']):>6} {_f(p['bias'], '+.3f'):>7} "
        f"{_f(p['mape_vs_frozen']):>9} {_f(p['mape_fresh_vs_frozen']):>9} {_f(p.get('estimator_prefill')):>8} "
        f"{_f(p.get('estimator_handoff')):>8} {_f(p['arrivals_after']):>8} {_f(p['heartbeat_age']):>7} "
        f"{rec['deflections']:>5} {rec['p95_ttft_s']:>6.2f} {rec['slo_attainment']:>7.4f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="bursty")
    ap.add_argument("--policy", default="kairos")
    ap.add_argument("--rps", default="3,4,5,6,7,8")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=90417)
    ap.add_argument("--stride", type=int, default=1, help="probe every N-th request (forks cost time)")
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "sim_prediction_error.json")
    ap.add_argument("--before", type=Path, help="an earlier JSON of this script to print beside")
    args = ap.parse_args()
    if args.stride < 1:
        ap.error("--stride must be >= 1")
    settings = SimSettings(workload=args.workload, duration_s=args.duration, seed=args.seed, policies=args.policy)
    before: dict[float, dict[str, Any]] = {}
    if args.before:
        before = {r["rps"]: r for r in json.loads(args.before.read_text())["records"]}
    records = []
    print(HEADER)
    for rps in (float(r) for r in args.rps.split(",")):
        rec = run(settings, args.policy, rps, args.stride)
        records.append(rec)
        for path in ("keep", "deflect"):
            if rps in before:
                print(row("before", before[rps], path))
            print(row("", rec, path), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    payload = {
        "benchmark": "sim_prediction_error",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "kairos_package": str(Path(sys.modules["kairos"].__file__ or "").parent),
        "script_commit": commit,
        "command": " ".join(["python", "-m", "bench.sim.prediction_error", *sys.argv[1:]]),
        "workload": args.workload,
        "duration_s": args.duration,
        "seed": args.seed,
        "stride": args.stride,
        "definitions": {
            "mape": "mean |pred - obs| / obs",
            "bias": "mean (pred - obs) / obs",
            "mape_vs_frozen": "mean |pred - frozen| / frozen: the error left with no arrival after the decision",
            "mape_fresh_vs_frozen": "mean |fresh - frozen| / frozen: the estimator, on exact inputs, no arrival after",
            "estimator_prefill / _handoff": "keep: the estimator's error split into Eq. 1 and the hand-off, / frozen",
            "arrivals_after": "mean |obs - frozen| / obs",
            "heartbeat_age": "mean |pred - fresh| / obs",
        },
        "records": records,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
