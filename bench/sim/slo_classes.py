"""Per-request SLOs (issue 33, items 2 and 3): attainment and goodput per SLO class for P/D, Kairos
with one global SLO and Kairos with classes, from low load to past P/D's knee, in the simulator.

    python -m bench.sim.slo_classes [--mix interactive_batch] [--rps 2,3,...] [--seeds 1,2]
                                    [--duration 1200] [--json PATH]

The workload is a mixed-class one (kairos.traffic.workloads.SLO_CLASS_MIXES): by default 30%
interactive chat (Azure conversation shape, TTFT 1 s, TPOT 60 ms) and 70% batch jobs (Bursty
shape, TTFT 20 s, TPOT 150 ms), on the reference 2P2D cluster. Each request is judged by its own
class's SLOs in every arm (joint: TTFT and its own P95 TBT). The arms:

- ``pd``: plain P/D;
- ``kairos:slo=off``: Kairos deciding every request by the one cluster SLO (TTFT 4 s, TBT 70 ms);
- ``kairos``: Kairos deciding each request by its own SLOs (Eq. 7's bound, Eq. 5's tau tightened
  on each decode node by the node's tightest TPOT in flight, the node's guard likewise).

P/D's knee, two ways: the highest rate at which P/D's overall attainment is at least
``--knee-attainment`` (0.9), and the highest at which every class's is (the overall figure is
mostly the batch class's, which P/D meets at every rate here). The target: at the knee the
interactive class keeps >= 99% attainment with classes, and the batch class's goodput (output
tokens per second of requests that met their SLOs) is not below P/D's; the verdict is given at
both. Figures are means over the seeds. Points run one after another in this process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.results import RESULTS_DIR, write_result
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.workloads import SLO_CLASS_MIXES, make_class_mix

POLICIES = ("pd", "kairos:slo=off", "kairos")
RATES = (2.0, 3.0, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, 8.0)
KEYS = ("slo_attainment", "goodput_rps", "goodput_tokens_per_s", "p95_ttft_s", "deflections")


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds' mean of each figure, overall and per class."""
    out: dict[str, Any] = {
        k: sum(r[k] for r in runs) / len(runs) for k in ("slo_attainment", "p95_ttft_s", "deflections")
    }
    names = list(dict.fromkeys(name for r in runs for name in r["per_class"]))
    out["per_class"] = {
        name: {k: sum(r["per_class"][name][k] for r in runs) / len(runs) for k in KEYS} for name in names
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="interactive_batch", choices=sorted(SLO_CLASS_MIXES))
    ap.add_argument("--rps", default=",".join(f"{r:g}" for r in RATES))
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--duration", type=float, default=1200.0, help="simulated seconds of arrivals per point")
    ap.add_argument("--knee-attainment", type=float, default=0.9)
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "sim_slo_classes.json")
    args = ap.parse_args()
    rates = [float(x) for x in args.rps.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    models = load_profile()
    started = time.perf_counter()
    points: list[dict[str, Any]] = []
    for rps in rates:
        for spec in POLICIES:
            runs = []
            for seed in seeds:
                requests = make_class_mix(args.mix, rps=rps, duration_s=args.duration, seed=seed)
                runs.append(Simulator(requests, create_policy(spec, models), models, ClusterConfig()).run().summary)
            point = {"rps": rps, "policy": spec, **mean_of(runs)}
            points.append(point)
            print_point(point, header=not points[:-1])
    line = args.knee_attainment
    pd = [p for p in points if p["policy"] == "pd"]
    knees = {
        "overall": max((p["rps"] for p in pd if p["slo_attainment"] >= line), default=None),
        "every_class": max(
            (p["rps"] for p in pd if all(k["slo_attainment"] >= line for k in p["per_class"].values())), default=None
        ),
    }
    verdict = {name: at_knee(points, knee, args.mix) for name, knee in knees.items()}
    for name, v in verdict.items():
        print(f"\nP/D's knee ({name} attainment >= {line:g}): {v}")
    write_result(
        "sim_slo_classes",
        {
            "command": "python -m bench.sim.slo_classes " + " ".join(sys.argv[1:]),
            "mix": args.mix,
            "classes": [vars_of(k) for k in SLO_CLASS_MIXES[args.mix]],
            "topology": "2P2D",
            "seeds": seeds,
            "duration_s": args.duration,
            "policies": list(POLICIES),
            "points": points,
            "verdict": verdict,
            "wall_s": time.perf_counter() - started,
        },
        args.json,
    )
    return 0


def at_knee(points: list[dict[str, Any]], knee: float | None, mix: str) -> dict[str, Any]:
    """The target's figures at P/D's knee ``knee``: the tight class's attainment with classes,
    the loose class's goodput with classes and with P/D."""
    out: dict[str, Any] = {"pd_knee_rps": knee}
    if knee is None:
        return out
    at = {p["policy"]: p for p in points if p["rps"] == knee}
    tight, loose = (k.name for k in SLO_CLASS_MIXES[mix][:2])
    out |= {
        "interactive_attainment_with_classes": at["kairos"]["per_class"][tight]["slo_attainment"],
        "interactive_attainment_pd": at["pd"]["per_class"][tight]["slo_attainment"],
        "batch_goodput_tokens_per_s_with_classes": at["kairos"]["per_class"][loose]["goodput_tokens_per_s"],
        "batch_goodput_tokens_per_s_pd": at["pd"]["per_class"][loose]["goodput_tokens_per_s"],
    }
    out["interactive_target_met"] = out["interactive_attainment_with_classes"] >= 0.99
    out["batch_target_met"] = out["batch_goodput_tokens_per_s_with_classes"] >= out["batch_goodput_tokens_per_s_pd"]
    return out


def vars_of(k: Any) -> dict[str, Any]:
    return {f: getattr(k, f) for f in k.__slots__}


def print_point(p: dict[str, Any], header: bool) -> None:
    if header:
        print(
            f"{'rps':>5} {'policy':<16} {'att':>6} {'defl':>6} | {'class':<12} {'att':>6} "
            f"{'good rps':>8} {'good tok/s':>10} {'p95 ttft':>8}"
        )
    for i, (name, c) in enumerate(p["per_class"].items()):
        lead = (
            f"{p['rps']:>5g} {p['policy']:<16} {p['slo_attainment']:>6.3f} {p['deflections']:>6.0f}"
            if i == 0
            else " " * 37
        )
        print(
            f"{lead} | {name:<12} {c['slo_attainment']:>6.3f} {c['goodput_rps']:>8.2f} "
            f"{c['goodput_tokens_per_s']:>10.1f} {c['p95_ttft_s']:>8.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
