"""Per-request SLO classes live (issue 33, item 3): one mixed-class trace replayed through a real
local cluster (Envoy, Redis, the dispatcher, sidecars, emulated 2P2D vLLM nodes in real time) per
policy, with each class's attainment and goodput beside the simulator's for the very same requests.

    python -m bench.live.slo_classes [--mix interactive_batch] [--rps 4] [--duration 180] [--seed 1]
                                     [--policies pd,kairos:slo=off,kairos] [--harness fair|shared]
                                     [--json PATH]

Every request carries its class's SLOs as the gateway's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
headers (the replay client sends them) and is judged by them, jointly on its TTFT and its own P95
TBT, as bench/sim/slo_classes.py judges the simulator's. The default rate is P/D's knee there
(the highest rate at which every class keeps 90% under P/D). Real time on shared cores: compare
the rows of one run, and each live row with its simulated twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.live_cluster import add_harness_argument, live_cluster
from bench.harness.results import write_result
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.launcher.replay import ReplayConfig, replay, summarize
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.simulator import ClusterConfig, Simulator
from kairos.traffic.workloads import SLO_CLASS_MIXES, make_class_mix

POLICIES = "pd,kairos:slo=off,kairos"
CLASS_KEYS = ("requests", "slo_attainment", "goodput_tokens_per_s", "p95_ttft_s", "deflections")


def class_figures(per_class: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The figures this benchmark reports of each class (live and simulated alike)."""
    return {name: {k: group.get(k) for k in CLASS_KEYS} for name, group in per_class.items()}


def simulated(requests: list[Any], policy: str) -> dict[str, Any]:
    """The simulator's overall and per-class figures for ``requests`` under ``policy``."""
    models = load_profile()
    summary = Simulator(requests, create_policy(policy, models), models, ClusterConfig()).run().summary
    return {
        "slo_attainment": summary["slo_attainment"],
        "p95_ttft_s": summary["p95_ttft_s"],
        "deflections": summary["deflections"],
        "per_class": class_figures(summary["per_class"]),
    }


def live(requests: list[Any], policy: str, model_dir: Path, workdir: Path, harness: str) -> dict[str, Any]:
    """The same figures measured through a fresh live cluster under ``policy``."""
    config = ReplayConfig(model_dir=str(model_dir), request_timeout_s=120.0)
    with live_cluster(policy, model_dir, 1.0, workdir, harness=harness) as (cluster, priority):
        run_config = dataclasses.replace(config, url=cluster.gateway_url)
        started = time.monotonic()
        results = replay(requests, run_config, stream=None)
        wall = time.monotonic() - started
    summary = summarize(results, run_config)
    return {
        "stand_ins_priority": priority,
        "wall_s": wall,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "slo_attainment": summary["slo_attainment"],
        "p95_ttft_s": summary["p95_ttft_s"],
        "deflections": summary["deflections"],
        "per_class": class_figures(summary["per_class"]),
    }


def print_row(policy: str, where: str, figures: dict[str, Any]) -> None:
    cells = "; ".join(
        f"{name} {c['slo_attainment']:.3f} att, {c['goodput_tokens_per_s']:.1f} good tok/s, "
        f"P95 TTFT {c['p95_ttft_s']:.2f} s, {c['deflections']:.0f} defl"
        for name, c in figures["per_class"].items()
    )
    print(f"{policy:<16} {where:<4} overall {figures['slo_attainment']:.3f} | {cells}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="interactive_batch", choices=sorted(SLO_CLASS_MIXES))
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals (real time)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default=POLICIES, help="','-separated policy specs")
    add_harness_argument(ap)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    requests = make_class_mix(args.mix, rps=args.rps, duration_s=args.duration, seed=args.seed)
    print(f"{args.mix} @ {args.rps:g} rps, seed {args.seed}: {len(requests)} requests over {args.duration:g} s")
    workroot = Path(tempfile.mkdtemp(prefix="kairos-live-slo-"))
    model_dir = build_tiny_model(workroot / "model")
    runs: list[dict[str, Any]] = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        workdir = workroot / policy.replace(":", "_").replace("=", "-")
        workdir.mkdir()
        run = {"policy": policy, "live": live(requests, policy, model_dir, workdir, args.harness)}
        run["simulated"] = simulated(requests, policy)
        print_row(policy, "live", run["live"])
        print_row(policy, "sim", run["simulated"])
        runs.append(run)
    write_result(
        "live_slo_classes",
        {
            "command": "python -m bench.live.slo_classes " + " ".join(sys.argv[1:]),
            "mix": args.mix,
            "classes": [{f: getattr(k, f) for f in k.__slots__} for k in SLO_CLASS_MIXES[args.mix]],
            "trace": {"rps": args.rps, "duration_s": args.duration, "seed": args.seed, "requests": len(requests)},
            "topology": "2P2D emulated, real time",
            "harness": args.harness,
            "runs": runs,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
