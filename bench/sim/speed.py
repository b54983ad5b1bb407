"""Simulator speed: simulated requests per wall-clock second for one hour and for 15 minutes of
Bursty at 10 RPS on 2P2D, for the P/D baseline and Kairos, in one run. Targets: >= 5,000
requests per wall second for the hour, and the hour's rate >= 0.8x the 15 minutes' (the cost per
request must not grow with the run's length; issue 15).

    python -m bench.sim.speed [--durations 3600,900] [--policies pd,kairos] [--repeat 3] [--rps 10] [--json PATH]

``--duration 900`` runs one length (the before-stop hook's smoke test).

Each row also gives the process CPU time of the run: on a shared machine the wall time also
counts waiting for a core, the CPU time much less so. Each run is repeated (``--repeat``) and the
fastest kept, as ``timeit`` does: what slows a run down on a shared machine is never the code.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.harness.results import write_result
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.sim.simulator import Simulator
from kairos.traffic.workloads import make_workload

POLICIES = ("pd", "kairos")
TARGET_PER_WALL_S = 5000.0
TARGET_RATIO = 0.8  # the longest run's rate over the shortest's


def measure(spec: str, duration_s: float, rps: float, repeat: int) -> dict[str, object]:
    models = load_profile()
    requests = make_workload("bursty", rps=rps, duration_s=duration_s, seed=1)
    runs = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = Simulator(requests, create_policy(spec, models), models).run()
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
    wall, cpu = min(runs)
    return {
        "policy": spec,
        "duration_s": duration_s,
        "requests": len(requests),
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_wall_s": len(requests) / wall,
        "requests_per_cpu_s": len(requests) / cpu,
        "deflections": metrics.summary["deflections"],
        "wall_s_of_each_run": [w for w, _ in runs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--durations", "--duration", dest="durations", default="3600,900", help="simulated seconds, comma-separated"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="policy specs, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the fastest is kept")
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    durations = sorted({float(d) for d in args.durations.split(",")}, reverse=True)
    policies = args.policies.split(",")
    rows = []
    for spec in policies:
        for d in durations:
            row = measure(spec, d, args.rps, args.repeat)
            rows.append(row)
            print(
                f"{spec:>7}: {row['requests']} requests, {d:g} simulated s in {row['wall_s']:.1f} s wall "
                f"({row['cpu_s']:.1f} s CPU) = {row['requests_per_wall_s']:,.0f} requests/s "
                f"({row['requests_per_cpu_s']:,.0f} per CPU s)",
                flush=True,
            )
    longest, shortest = durations[0], durations[-1]
    print(f"Bursty {args.rps:g} RPS, 2P2D: simulated requests per second of wall (of CPU)")
    print(f"{'policy':>7}  " + "  ".join(f"{d:>8g} s sim" for d in durations) + "  ratio (wall, cpu)")
    ratios = {}
    for spec in policies:
        by_duration = {r["duration_s"]: r for r in rows if r["policy"] == spec}
        cells = "  ".join(
            f"{by_duration[d]['requests_per_wall_s']:>6,.0f} ({by_duration[d]['requests_per_cpu_s']:,.0f})"
            for d in durations
        )
        wall_ratio = by_duration[longest]["requests_per_wall_s"] / by_duration[shortest]["requests_per_wall_s"]
        cpu_ratio = by_duration[longest]["requests_per_cpu_s"] / by_duration[shortest]["requests_per_cpu_s"]
        ratios[spec] = {"wall": wall_ratio, "cpu": cpu_ratio}
        print(f"{spec:>7}  {cells}  {wall_ratio:.2f}, {cpu_ratio:.2f}")
    met = all(r["requests_per_wall_s"] >= TARGET_PER_WALL_S for r in rows if r["duration_s"] == longest) and all(
        ratio["wall"] >= TARGET_RATIO for ratio in ratios.values()
    )
    print(f"targets (>= {TARGET_PER_WALL_S:,.0f}/wall s for {longest:g} s, ratio >= {TARGET_RATIO}) met: {met}")
    write_result(
        "sim_speed",
        {
            "rps": args.rps,
            "durations_s": durations,
            "rows": rows,
            "ratio_longest_to_shortest": ratios,
            "target_met": met,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
