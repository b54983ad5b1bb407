"""Never worse than P/D (issue 15, part 5): P/D and Kairos side by side on the long-output
workloads, from low load to decode overload, in the simulator.

    python -m bench.sim.never_worse [--workloads lphd,azure_conv] [--seeds 1,2,3] [--duration 1200]
                                    [--policies 'pd;pd@hb=101;kairos:alpha=1.3,gate=off;kairos'] [--rps R,R]
                                    [--error E] [--json PATH]

Every policy after the first is compared with the first (P/D) at each workload and rate on the
same requests, seed by seed. ``pd@hb=101`` (in the default list) is the control: P/D itself with
heartbeats every 101 ms instead of 100, a change no decision rule makes, which measures how far
two runs of the same policy drift apart past the knee. The target: P95 TTFT <= 1.05x P/D's,
joint SLO attainment >= P/D's - 0.5 points and TBT violations (decode steps over tau) <= P/D's
+ 0.1 points. Past the decode knee a run is chaotic (one request routed differently moves every
later step), so the table gives the mean over the seeds and, beside it, how many single seeds
miss the target.

Points run one after another in this process (the machine is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.results import RESULTS_DIR, write_result
from kairos.sim.experiment import SimSettings, run_point

# Low load to decode overload on 2P2D with the default profile: P/D's TBT violations start near
# 18 RPS on LPHD and 17 RPS on azure_conv.
RATES: dict[str, tuple[float, ...]] = {
    "lphd": (10.0, 14.0, 16.0, 18.0, 19.0, 20.0, 22.0),
    "azure_conv": (8.0, 12.0, 14.0, 16.0, 17.0, 18.0, 19.0, 20.0),
}
TTFT_RATIO = 1.05  # P95 TTFT <= 1.05x P/D's
ATTAINMENT_POINTS = 0.5  # joint SLO attainment >= P/D's - 0.5 points
VIOLATION_POINTS = 0.1  # TBT violation rate <= P/D's + 0.1 points
KEYS = ("p95_ttft_s", "slo_attainment", "tbt_violation_rate", "deflections")


def misses(rec: dict[str, Any], pd: dict[str, Any]) -> list[str]:
    """Which parts of the target ``rec`` misses against ``pd`` (figures as in the records)."""
    out = []
    if rec["p95_ttft_s"] > TTFT_RATIO * pd["p95_ttft_s"]:
        out.append("ttft")
    if 100 * (pd["slo_attainment"] - rec["slo_attainment"]) > ATTAINMENT_POINTS:
        out.append("attainment")
    if 100 * (rec["tbt_violation_rate"] - pd["tbt_violation_rate"]) > VIOLATION_POINTS:
        out.append("tbt")
    return out


def mean(records: list[dict[str, Any]]) -> dict[str, float]:
    return {k: sum(r[k] for r in records) / len(records) for k in KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="lphd,azure_conv")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--duration", type=float, default=1200.0, help="simulated seconds of arrivals per point")
    ap.add_argument(
        "--policies", default="pd;pd@hb=101;kairos:alpha=1.3,gate=off;kairos", help="';'-separated, P/D first"
    )
    ap.add_argument("--rps", default=None, help="rates for every workload (default: each workload's sweep)")
    ap.add_argument("--error", type=float, default=0.0, help="simulated step-time error (0.1 = 10%% MAE)")
    ap.add_argument("--json", type=Path, default=None, help="default bench/results/sim_never_worse[_errorN].json")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(";")
    started = time.perf_counter()

    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for wl in workloads:
        rates = tuple(float(r) for r in args.rps.split(",")) if args.rps else RATES[wl]
        for rps in rates:
            by_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            for seed in seeds:
                settings = SimSettings(
                    workload=wl, rps=(rps,), duration_s=args.duration, seed=seed, error=args.error, jobs=1
                )
                for spec in policies:
                    policy, _, hb = spec.partition("@hb=")
                    point = dataclasses.replace(settings, heartbeat_s=float(hb) / 1e3) if hb else settings
                    rec = {**run_point(point, policy, rps), "policy_spec": spec}
                    records.append(rec)
                    by_policy[spec].append(rec)
            pd = mean(by_policy[policies[0]])
            for spec in policies:
                m = mean(by_policy[spec])
                seed_misses = [misses(r, p) for r, p in zip(by_policy[spec], by_policy[policies[0]], strict=True)]
                rows.append(
                    {
                        "workload": wl,
                        "rps": rps,
                        "policy": spec,
                        **m,
                        "ttft_vs_pd": m["p95_ttft_s"] / pd["p95_ttft_s"],
                        "attainment_vs_pd_points": 100 * (m["slo_attainment"] - pd["slo_attainment"]),
                        "tbt_violations_vs_pd_points": 100 * (m["tbt_violation_rate"] - pd["tbt_violation_rate"]),
                        "misses_on_mean": misses(m, pd),
                        "seeds_missing": sum(bool(x) for x in seed_misses),
                    }
                )
            print_rows(rows[-len(policies) :], header=rps == rates[0] and wl == workloads[0])

    failing = [r for r in rows if r["misses_on_mean"]]
    print(f"\n{len(failing)} of {len(rows)} rows miss the target on the seed mean:")
    for r in failing:
        print(f"  {r['workload']} {r['rps']:g} RPS {r['policy']}: {', '.join(r['misses_on_mean'])}")
    write_result(
        "sim_never_worse",
        {
            "command": "python -m bench.sim.never_worse " + " ".join(sys.argv[1:]),
            "workloads": workloads,
            "seeds": seeds,
            "duration_s": args.duration,
            "error": args.error,
            "policies": policies,
            "topology": "2P2D",
            "target": {
                "p95_ttft_vs_pd_max": TTFT_RATIO,
                "attainment_points_below_pd_max": ATTAINMENT_POINTS,
                "tbt_violation_points_above_pd_max": VIOLATION_POINTS,
            },
            "wall_s": time.perf_counter() - started,
            "table": rows,
            "records": records,
        },
        args.json or RESULTS_DIR / f"sim_never_worse{f'_error{round(100 * args.error)}' if args.error else ''}.json",
    )
    return 0


def print_rows(rows: list[dict[str, Any]], header: bool) -> None:
    if header:
        print(
            f"{'workload':<11}{'rps':>5}  {'policy':<24}{'P95 TTFT s':>11}{'vs PD':>7}{'attain %':>10}{'vs PD':>7}"
            f"{'TBT viol %':>11}{'vs PD':>7}{'deflect':>9}  seeds missing / misses on mean"
        )
    for r in rows:
        print(
            f"{r['workload']:<11}{r['rps']:>5g}  {r['policy']:<24}{r['p95_ttft_s']:>11.3f}{r['ttft_vs_pd']:>7.3f}"
            f"{100 * r['slo_attainment']:>10.2f}{r['attainment_vs_pd_points']:>+7.2f}"
            f"{100 * r['tbt_violation_rate']:>11.2f}{r['tbt_violations_vs_pd_points']:>+7.2f}{r['deflections']:>9.1f}"
            f"  {r['seeds_missing']} {','.join(r['misses_on_mean']) or '-'}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
