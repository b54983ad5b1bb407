"""End to end, prefix caching (issue 12): the multi-turn conversation workload replayed through a
real local cluster (Envoy, Redis, the dispatcher, sidecars, emulated 2P2D vLLM nodes), with Kairos
and P/D each prefix-aware and cache-blind, from low load up.

    python -m bench.live.prefix [--rates 4,8,12,16] [--duration 120] [--time-scale 1] [--seed 12]
                                [--policies kairos,kairos:prefix=off,pd,pd:prefix=off]
                                [--trace FILE] [--dispatchers 1] [--harness fair|shared]
                                [--json PATH] [--plots DIR]

Each (policy, rate) point gets a fresh cluster, so every run starts with cold caches. ``kairos
replay`` sends the sessions as conversations: each first turn at its arrival time, each later
turn a think time after the previous answer, its prompt the previous prompt + the answer the node
streamed + a new message, so the nodes see each turn resend the conversation so far and sessions
share their system prompts byte for byte. ``--trace FILE`` replays a trace instead, rescaled to
each rate and cut at ``--duration`` (a Mooncake trace's ``hash_ids`` become shared token blocks; a
JSONL trace with session ids replays as conversations). Per point it prints P95 TTFT overall, of first turns and
of later turns, P95 TBT and the share of token gaps over tau, joint SLO attainment, deflections,
and the prefix hit rates per route (``deflect``: the decode node's own cache; ``keep``: the
prefill node's) from the nodes' ``usage.prompt_tokens_details.cached_tokens``.
Then the issue's comparison at the lowest rate where prefix-aware P/D's P95 TTFT passes the SLO:
Kairos's turn >= 2 P95 TTFT over P/D's, and Kairos's attainment against P/D's at every rate.
``--plots DIR`` draws the simulator's figures for these records (:mod:`kairos.sim.plots`: P95
TTFT and TBT, throughput, attainment and deflections, and later turns' P95 TTFT).

Times are model seconds (wall x ``--time-scale``, the emulated nodes' speed-up). ``--harness``
as bench/live/replay.py's: fair (default) runs the stand-ins for GPU hosts, Redis and the client
above the gateway.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.live_cluster import add_harness_argument, live_cluster, resyncs
from bench.harness.results import RESULTS_DIR, write_result
from kairos.common import defaults
from kairos.core.policies import split_policy_list
from kairos.launcher.replay import ReplayConfig, replay, summarize
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.plots import write_plots
from kairos.traffic.requests import RequestSpec
from kairos.traffic.traces import load_trace, rescale_to_rate, truncate
from kairos.traffic.workloads import make_workload

WORKLOAD = "multiturn"
POLICIES = "kairos,kairos:prefix=off,pd,pd:prefix=off"
TTFT_SLO_S = defaults.TTFT_SLO_S
TBT_SLO_MS = defaults.TBT_SLO_S * 1e3
# What each point keeps of the replay's summary (the simulator's names where they mean the same).
FIELDS = (
    "requests",
    "errors",
    "p50_ttft_s",
    "p95_ttft_s",
    "p99_ttft_s",
    "p95_ttft_turn1_s",
    "p95_ttft_turn2plus_s",
    "p50_tbt_ms",
    "p95_tbt_ms",
    "p99_tbt_ms",
    "tbt_violation_rate",
    "slo_attainment",
    "deflections",
    "keeps",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "prefix_hit_rate",
    "cached_tokens_reported",
    "later_turns_sent",
    "later_turns_prefix_broken",
    "max_send_lag_ms",
    "error_kinds",
)


def traffic(rps: float, args: argparse.Namespace) -> list[RequestSpec]:
    if args.trace is None:
        return make_workload(WORKLOAD, rps=rps, duration_s=args.duration, seed=args.seed)
    return truncate(rescale_to_rate(load_trace(args.trace), rps), args.duration)


def run_point(policy: str, rps: float, args: argparse.Namespace, model_dir: Path, workroot: Path) -> dict[str, Any]:
    """One fresh cluster under ``policy``, the traffic at ``rps`` replayed through it."""
    trace = traffic(rps, args)
    workdir = workroot / f"{policy.replace(':', '_').replace('=', '-').replace(',', '_')}-{rps:g}"
    print(f"\n{policy} @ {rps:g} turns/s: {len(trace)} turns, fresh cluster", flush=True)
    live = live_cluster(policy, model_dir, args.time_scale, workdir, args.dispatchers, args.harness)
    with live as (cluster, priority):
        config = ReplayConfig(
            url=cluster.gateway_url,
            model_dir=str(model_dir),
            time_scale=args.time_scale,
            ttft_slo_s=TTFT_SLO_S,
            tbt_slo_ms=TBT_SLO_MS,
            request_timeout_s=120.0,
        )
        t0 = time.monotonic()
        results = replay(trace, config)
        wall = time.monotonic() - t0
    summary = summarize(results, config)
    per_route = summary["per_route"]
    return {
        "policy": policy,
        "policy_spec": policy,
        "workload": args.trace.stem if args.trace else WORKLOAD,
        "rps": rps,
        "ttft_slo_s": TTFT_SLO_S,
        "tbt_slo_ms": TBT_SLO_MS,
        **{k: summary[k] for k in FIELDS},
        "prefix_hit_rate_keep": per_route.get("keep", {}).get("prefix_hit_rate"),
        "prefix_hit_rate_deflect": per_route.get("deflect", {}).get("prefix_hit_rate"),
        "per_route": per_route,
        "engine_resyncs": resyncs(workdir),
        "stand_ins_priority": priority,
        "wall_s": wall,
    }


def _cell(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def print_table(records: list[dict[str, Any]]) -> None:
    print(f"\n## {records[0]['workload']} through the gateway (2P2D, emulated nodes; model time)")
    print(
        f"{'policy':<19}{'rps':>5}{'P95 TTFT':>10}{'turn 1':>8}{'turn>=2':>9}{'P95 TBT':>9}{'viol %':>8}"
        f"{'attain %':>9}{'defl':>6}{'hit %':>7}{'keep':>7}{'defl':>7}{'err':>5}"
    )
    for r in records:
        print(
            f"{r['policy']:<19}{r['rps']:>5g}{_cell(r['p95_ttft_s'], '.2f'):>10}"
            f"{_cell(r['p95_ttft_turn1_s'], '.2f'):>8}"
            f"{_cell(r['p95_ttft_turn2plus_s'], '.2f'):>9}{_cell(r['p95_tbt_ms'], '.1f'):>9}"
            f"{_cell(r['tbt_violation_rate'], '.2f', 100):>8}{_cell(r['slo_attainment'], '.1f', 100):>9}"
            f"{r['deflections']:>6}{_cell(r['prefix_hit_rate'], '.1f', 100):>7}"
            f"{_cell(r['prefix_hit_rate_keep'], '.1f', 100):>7}{_cell(r['prefix_hit_rate_deflect'], '.1f', 100):>7}"
            f"{r['errors']:>5}",
            flush=True,
        )


def comparison(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Kairos against prefix-aware P/D: turn >= 2 P95 TTFT at P/D's first rate past the TTFT SLO,
    and attainment at every rate (None where a policy did not run)."""
    by = {(r["policy"], r["rps"]): r for r in records}
    rates = sorted({r["rps"] for r in records})
    if not all(("kairos", x) in by and ("pd", x) in by for x in rates):
        return {}
    knee = next((x for x in rates if (by["pd", x]["p95_ttft_s"] or 0.0) > TTFT_SLO_S), None)
    ratio = None
    if knee is not None:
        k, p = by["kairos", knee]["p95_ttft_turn2plus_s"], by["pd", knee]["p95_ttft_turn2plus_s"]
        ratio = k / p if k is not None and p else None
    return {
        "pd_first_over_ttft_slo_rps": knee,
        "kairos_over_pd_turn2plus_p95_ttft_there": ratio,
        "kairos_attainment_minus_pd_points": {
            f"{x:g}": 100 * ((by["kairos", x]["slo_attainment"] or 0.0) - (by["pd", x]["slo_attainment"] or 0.0))
            for x in rates
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="4,8,12,16", help="turns per second, lowest first")
    ap.add_argument("--duration", type=float, default=120.0, help="model seconds of session arrivals per point")
    ap.add_argument("--time-scale", type=float, default=1.0, help="emulated nodes' speed-up over real time")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--policies", default=POLICIES, help="policy specs as the dispatcher takes them")
    ap.add_argument("--trace", type=Path, help="replay this trace (rescaled to each rate) instead of multiturn")
    ap.add_argument("--dispatchers", type=int, default=1, help="dispatcher replicas behind Envoy")
    add_harness_argument(ap)
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "e2e_prefix.json")
    ap.add_argument("--plots", type=Path, help="write the figures here")
    args = ap.parse_args()
    started = time.monotonic()
    rates = [float(x) for x in args.rates.split(",")]
    policies = split_policy_list(args.policies)
    workroot = Path(tempfile.mkdtemp(prefix="kairos-e2e-prefix-"))
    model_dir = build_tiny_model(workroot / "model")
    records = [run_point(policy, rps, args, model_dir, workroot) for policy in policies for rps in rates]
    print_table(records)
    goals = comparison(records)
    if goals:
        print("\nKairos vs prefix-aware P/D:", goals)
    notes: list[str] = []
    if not any(r["cached_tokens_reported"] for r in records):
        notes.append(
            "no node reported cached tokens (usage.prompt_tokens_details.cached_tokens): the nodes ran without "
            "prefix caching, so prefix-aware and cache-blind policies served the same caches (none)"
        )
    for r in records:
        where = f"{r['policy']} @ {r['rps']:g}"
        if r["errors"]:
            notes.append(f"{where}: {r['errors']} requests failed: {r['error_kinds']}")
        if r["later_turns_prefix_broken"]:
            notes.append(f"{where}: {r['later_turns_prefix_broken']} later turns lost part of the previous prompt")
        if r["engine_resyncs"]:
            notes.append(f"{where}: emulated nodes fell behind the clock {r['engine_resyncs']} times (CPU-starved)")
    for note in notes:
        print(f"note: {note}")
    if args.plots:
        for path in write_plots(records, args.plots):
            print(f"wrote {path}")
    write_result(
        "e2e_prefix",
        {
            "command": "python -m bench.live.prefix " + " ".join(sys.argv[1:]),
            "workload": records[0]["workload"],
            "trace": str(args.trace) if args.trace else None,
            "seed": args.seed,
            "duration_s": args.duration,
            "time_scale": args.time_scale,
            "topology": "2P2D",
            "dispatchers": args.dispatchers,
            "harness": args.harness,
            "slos": {"p95_ttft_s": TTFT_SLO_S, "tbt_ms": TBT_SLO_MS},
            "comparison": goals,
            "notes": notes,
            "total_wall_s": time.monotonic() - started,
            "records": records,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
