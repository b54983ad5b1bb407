"""Simulator speed: simulated requests per wall-clock second for one hour of Bursty at 10 RPS
on 2P2D (target >= 2,000), for the P/D baseline and Kairos, measured in one run.

    python bench/sim_speed.py [--duration 3600] [--rps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_result
from kairos.core.latency import load_profile
from kairos.core.policies import make_policy
from kairos.sim.simulator import Simulator
from kairos.sim.workloads import make_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    models = load_profile()
    t0 = time.perf_counter()
    requests = make_workload("bursty", rps=args.rps, duration_s=args.duration, seed=1)
    gen_s = time.perf_counter() - t0
    rows = []
    for spec in ("pd", "kairos"):
        t0 = time.perf_counter()
        metrics = Simulator(requests, make_policy(spec, models), models).run()
        wall = time.perf_counter() - t0
        rate = len(requests) / wall
        rows.append({"policy": spec, "requests": len(requests), "wall_s": wall, "requests_per_wall_s": rate,
                     "deflections": metrics.summary["deflections"]})
        print(f"{spec:>7}: {len(requests)} requests, {args.duration:g} simulated s in {wall:.1f} s wall "
              f"= {rate:,.0f} requests/s")
    met = all(r["requests_per_wall_s"] >= 2000 for r in rows)
    print(f"workload generation {gen_s:.2f} s; target >= 2,000 requests/s met: {met}")
    write_result("sim_speed", {"rps": args.rps, "duration_s": args.duration, "rows": rows,
                               "target_met": met}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
