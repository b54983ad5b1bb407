"""Prefix caching in the simulator (issue 12): Kairos and P/D, each prefix-aware and cache-blind,
on the multi-turn conversation workload from low load to past P/D's knee, and on Bursty (no
shared prefixes), where prefix awareness must change nothing.

    python -m bench.sim.prefix [--duration 600] [--seed 12] [--rps 4,8,...] [--bursty-rps 3,4,5,6]
                               [--jobs N] [--json PATH] [--plots DIR]

Every node caches blocks (vLLM's default) under every policy; "cache-blind" is a decider that
ignores the hits (``:prefix=off``), not nodes without a cache. The simulator reads each node's
hit from its engine (the truth); a second multi-turn sweep runs prefix-aware Kairos and P/D on
the dispatcher's index of the nodes' KV-cache events instead, delivered with each heartbeat
(``--no-index`` skips it). Per rate it prints P95 TTFT overall and for turns >= 2, P95 TBT
and the share of decode steps over tau, joint SLO attainment, deflections and the prefix hit
rates (prefill nodes: cached share of the prompts they prefilled; decode nodes: the share of
every prompt they neither computed nor received). Then the issue's targets: at the lowest rate
where prefix-aware P/D's P95 TTFT passes 4 s, Kairos's turn >= 2 P95 TTFT over P/D's (<= 0.5);
Kairos's attainment >= prefix-aware P/D's at every rate; Kairos's TBT violations (0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.results import RESULTS_DIR, write_result
from kairos.common import defaults
from kairos.sim.experiment import SimSettings, run_sweep
from kairos.sim.plots import write_plots

RATES = (4.0, 8.0, 12.0, 14.0, 16.0, 17.0, 18.0, 19.0, 20.0, 22.0)
BURSTY_RATES = (3.0, 4.0, 5.0, 6.0)
POLICIES = ("kairos", "kairos:prefix=off", "pd", "pd:prefix=off")
FIELDS = (
    "p95_ttft_s",
    "p95_ttft_turn2plus_s",
    "p95_tbt_ms",
    "tbt_violation_rate",
    "slo_attainment",
    "deflections",
    "prefix_hit_rate_prefill",
    "prefix_hit_rate_decode",
    "requests",
)


def sweep(
    workload: str,
    rates: tuple[float, ...],
    args: argparse.Namespace,
    policies: tuple[str, ...] = POLICIES,
    index: bool = False,
) -> list[dict[str, Any]]:
    settings = SimSettings(
        workload=workload,
        policies=";".join(policies),
        rps=rates,
        duration_s=args.duration,
        seed=args.seed,
        jobs=args.jobs,
        prefix_index=index,
    )
    return run_sweep(settings)  # fmt: skip


def table(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """policy spec -> rate -> the reported fields."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        out.setdefault(r["policy_spec"], {})[f"{r['rps']:g}"] = {k: r[k] for k in FIELDS}
    return out


def print_table(title: str, rows: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n## {title}")
    print(
        f"{'policy':<19}{'rps':>5}{'P95 TTFT':>10}{'turn>=2':>9}{'P95 TBT':>9}{'viol %':>8}{'attain %':>9}"
        f"{'defl':>6}{'hit P %':>8}{'hit D %':>8}"
    )
    for spec, per_rate in rows.items():
        for rate, f in per_rate.items():
            print(
                f"{spec:<19}{rate:>5}{f['p95_ttft_s']:>10.2f}{f['p95_ttft_turn2plus_s']:>9.2f}{f['p95_tbt_ms']:>9.1f}"
                f"{100 * f['tbt_violation_rate']:>8.2f}{100 * f['slo_attainment']:>9.1f}{f['deflections']:>6.0f}"
                f"{100 * f['prefix_hit_rate_prefill']:>8.1f}{100 * f['prefix_hit_rate_decode']:>8.1f}",
                flush=True,
            )


def targets(rows: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    pd, kairos = rows["pd"], rows["kairos"]
    rates = sorted(pd, key=float)
    knee = next((r for r in rates if pd[r]["p95_ttft_s"] > defaults.TTFT_SLO_S), None)
    ratio = kairos[knee]["p95_ttft_turn2plus_s"] / pd[knee]["p95_ttft_turn2plus_s"] if knee else None
    return {
        "pd_prefix_first_over_4s_rps": None if knee is None else float(knee),
        "kairos_over_pd_turn2plus_p95_ttft_there": ratio,
        "ratio_target_met": ratio is not None and ratio <= 0.5,
        "kairos_attainment_ge_pd_every_rate": all(
            kairos[r]["slo_attainment"] >= pd[r]["slo_attainment"] for r in rates
        ),
        "kairos_tbt_violations": {r: kairos[r]["tbt_violation_rate"] for r in rates},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds of session arrivals per point")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--rps", default=",".join(f"{r:g}" for r in RATES), help="multi-turn rates (turns/s)")
    ap.add_argument("--bursty-rps", default=",".join(f"{r:g}" for r in BURSTY_RATES))
    ap.add_argument("--jobs", type=int, default=0, help="parallel simulations (default: one per core)")
    ap.add_argument("--no-index", action="store_true", help="skip the sweep on the KV-event index")
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "sim_prefix.json")
    ap.add_argument("--plots", type=Path, default=None, help="write the multi-turn sweep's figures here")
    args = ap.parse_args()
    started = time.perf_counter()
    rates = tuple(float(r) for r in args.rps.split(","))
    multiturn = sweep("multiturn", rates, args)
    rows = table(multiturn)
    print_table("multiturn: prefix-aware and cache-blind Kairos and P/D (2P2D)", rows)
    goals = targets(rows)
    print("\ntargets:", goals)
    if args.plots:
        for path in write_plots(multiturn, args.plots):
            print(f"wrote {path}")
    events_rows: dict[str, dict[str, dict[str, float]]] = {}
    events_goals: dict[str, Any] = {}
    if not args.no_index:
        events = sweep("multiturn", rates, args, ("kairos", "pd"), index=True)
        events_rows = table(events)
        print_table("multiturn, hits from the KV-event index (heartbeat-delivered)", events_rows)
        events_goals = targets(events_rows)
        print("\ntargets on the index:", events_goals)
    bursty_rates = tuple(float(r) for r in args.bursty_rps.split(","))
    bursty = sweep("bursty", bursty_rates, args)
    bursty_rows = table(bursty)
    print_table("bursty (no shared prefixes)", bursty_rows)
    same = all(bursty_rows[a] == bursty_rows[b] for a, b in (("kairos", "kairos:prefix=off"), ("pd", "pd:prefix=off")))
    print(f"\nbursty: prefix-aware == cache-blind, every figure: {same}")
    write_result(
        "sim_prefix",
        {
            "command": "python -m bench.sim.prefix " + " ".join(sys.argv[1:]),
            "seed": args.seed,
            "duration_s": args.duration,
            "topology": "2P2D",
            "truth": "model (error 0)",
            "slos": {"p95_ttft_s": defaults.TTFT_SLO_S, "p95_tbt_ms": defaults.TBT_SLO_S * 1e3},
            "policies": list(POLICIES),
            "wall_s": time.perf_counter() - started,
            "multiturn": rows,
            "targets": goals,
            "multiturn_event_index": events_rows,
            "targets_event_index": events_goals,
            "bursty": bursty_rows,
            "bursty_prefix_aware_equals_cache_blind": same,
            "records": multiturn + bursty,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
