"""The keep path's TTFT estimate against the simulator (issue 15, item 3): per path, the
dispatcher's predicted TTFT against the simulated one, and what the decisions came to.

    python -m bench.sim.keep_estimate [--workload bursty] [--policies pd,kairos,kairos:keep=eq1]
                                      [--rps 3,5,7] [--duration 600] [--seed 90417]
                                      [--json PATH] [--before PATH]

Per policy and rate: the keep path's MAPE and signed bias (mean (predicted - observed) /
observed), the deflect path's MAPE, the keep path's mean observed TTFT split into prefill queue +
execution (what Eq. 1 predicts) and transfer + decode queue (what it leaves out), P95 TTFT, SLO
attainment and deflections. The error is computed here from the request records (the predicted
TTFT each decision carried, the simulated TTFT), not from the summary's keys, so the script also
measures a tree from before the per-path split: run it with that tree's package first on
PYTHONPATH. ``--before`` prints the figures of an earlier JSON beside these, matched by policy
spec and rate.

Points run one after another in this process (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.results import RESULTS_DIR
from kairos.core.decision import Route
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy, split_policy_list
from kairos.sim.experiment import SimSettings, requests_for
from kairos.sim.simulator import Simulator


def _mape(pred: np.ndarray, obs: np.ndarray, signed: bool = False) -> float | None:
    if pred.size == 0:
        return None
    err = (pred - obs) / obs
    return float(np.mean(err if signed else np.abs(err)))


def run(settings: SimSettings, spec: str, rps: float) -> dict[str, Any]:
    models = load_profile(settings.profile)
    policy = create_policy(spec, models, settings.decider())
    started = time.perf_counter()
    metrics = Simulator(requests_for(settings, rps), policy, models, settings.cluster()).run()
    wall = time.perf_counter() - started
    recs = [r for r in metrics.records if r.predicted_ttft_s is not None]
    keep = [r for r in recs if r.route is Route.KEEP]
    deflect = [r for r in recs if r.route is Route.DEFLECT]
    kp = np.array([r.predicted_ttft_s for r in keep])
    ko = np.array([r.ttft for r in keep])
    dp = np.array([r.predicted_ttft_s for r in deflect])
    do = np.array([r.ttft for r in deflect])
    parts = np.array([r.ttft_parts() for r in keep]) if keep else np.zeros((0, 4))
    s = metrics.summary
    return {
        "policy": policy.label,
        "policy_spec": spec,
        "rps": rps,
        "requests": s["requests"],
        "keeps": len(keep),
        "deflections": s["deflections"],
        "keep_mape": _mape(kp, ko),
        "keep_bias": _mape(kp, ko, signed=True),
        "deflect_mape": _mape(dp, do),
        "all_mape": _mape(np.concatenate([kp, dp]), np.concatenate([ko, do])),
        "keep_mean_observed_s": float(ko.mean()) if keep else None,
        "keep_mean_predicted_s": float(kp.mean()) if keep else None,
        "keep_mean_prefill_s": float((parts[:, 0] + parts[:, 1]).mean()) if keep else None,
        "keep_mean_handoff_s": float((parts[:, 2] + parts[:, 3]).mean()) if keep else None,
        "p95_ttft_s": s["p95_ttft_s"],
        "p95_ttft_keep_s": s["p95_ttft_keep_s"],
        "p95_ttft_deflect_s": s["p95_ttft_deflect_s"],
        "slo_attainment": s["slo_attainment"],
        "tbt_violation_rate": s["tbt_violation_rate"],
        "wall_s": wall,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="bursty")
    ap.add_argument("--policies", default="pd,kairos,kairos:keep=eq1")
    ap.add_argument("--rps", default="3,5,7")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=90417)
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "sim_keep_estimate.json")
    ap.add_argument("--before", type=Path, help="an earlier JSON of this script to print beside")
    args = ap.parse_args()
    settings = SimSettings(workload=args.workload, duration_s=args.duration, seed=args.seed, policies=args.policies)
    rates = [float(r) for r in args.rps.split(",")]
    before: dict[tuple[str, float], dict[str, Any]] = {}
    if args.before:
        for rec in json.loads(args.before.read_text())["records"]:
            before[(rec["policy_spec"], rec["rps"])] = rec
    records = []
    print(
        f"{'policy':<34} {'rps':>4} {'keep MAPE':>9} {'bias':>7} {'defl MAPE':>9} {'obs keep':>8} "
        f"{'Eq1 part':>8} {'handoff':>7} {'P95 TTFT':>8} {'attain':>7} {'defl':>5}"
    )
    for rps in rates:
        for spec in split_policy_list(args.policies):
            rec = run(settings, spec, rps)
            records.append(rec)
            rows = [("", rec)]
            if (spec, rps) in before:
                rows.insert(0, ("before ", before[(spec, rps)]))
            for tag, r in rows:
                print(
                    f"{(tag + r['policy'])[:34]:<34} {r['rps']:>4g} {_f(r['keep_mape'], '.3f'):>9} "
                    f"{_f(r['keep_bias'], '+.3f'):>7} {_f(r['deflect_mape'], '.3f'):>9} "
                    f"{_f(r['keep_mean_observed_s'], '.3f'):>8} {_f(r['keep_mean_prefill_s'], '.3f'):>8} "
                    f"{_f(r['keep_mean_handoff_s'], '.3f'):>7} {r['p95_ttft_s']:>8.3f} "
                    f"{r['slo_attainment']:>7.4f} {r['deflections']:>5}",
                    flush=True,
                )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    payload = {
        "benchmark": "sim_keep_estimate",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "kairos_package": str(Path(sys.modules["kairos"].__file__ or "").parent),
        "script_commit": commit,
        "command": " ".join(sys.argv),
        "workload": args.workload,
        "duration_s": args.duration,
        "seed": args.seed,
        "records": records,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
