"""The keep path's TTFT estimate live (issue 15, item 3): a short real-time Bursty replay through
a local cluster (Envoy, Redis, the dispatcher, sidecars, emulated 2P2D vLLM nodes) per policy,
reading every request's predicted and observed TTFT from the sidecars' feedback stream
(``kairos:ttft-feedback``: the prediction the dispatcher sent for the path it chose, and the
sidecar's arrival-to-first-byte), per path.

    python -m bench.live.keep_estimate [--policies 'kairos:keep=eq1;kairos'] [--rps 3]
                                       [--duration 90] [--seed 1] [--harness fair|shared] [--json PATH]

Per policy: the keep path's and the deflect path's MAPE and signed bias over the run's stream
entries (all of them, not the dispatcher's rolling window), with the replay's P95 TTFT,
attainment and deflections. ``kairos:keep=eq1`` decides and predicts as the paper's Eq. 1 (what
``kairos`` did before the full keep estimate). Real time on a shared 2-core machine: the
gateway's own hops and CPU contention count, so compare the two rows of one run. ``--harness``
as bench/live/replay.py's (fair, the default: the stand-ins for other machines above the gateway).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from bench.harness.live_cluster import add_harness_argument, live_cluster
from bench.harness.results import write_result
from kairos.common.contracts import REDIS_TTFT_FEEDBACK_STREAM
from kairos.extproc.feedback import MalformedFeedback, parse_entry
from kairos.launcher.replay import ReplayConfig, replay, summarize
from kairos.launcher.tinymodel import build_tiny_model
from kairos.traffic.workloads import make_workload


def per_path(entries: list[tuple[Any, dict[Any, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"malformed": 0}
    samples: dict[str, list[tuple[float, float]]] = {"keep": [], "deflect": []}
    for _, fields in entries:
        try:
            s = parse_entry(fields)
        except MalformedFeedback:
            out["malformed"] += 1
            continue
        samples[s.path].append((s.predicted_s, s.observed_s))
    for path, pairs in samples.items():
        errs = [(p - o) / o for p, o in pairs]
        out[path] = {
            "samples": len(pairs),
            "mape": sum(abs(e) for e in errs) / len(errs) if errs else None,
            "bias": sum(errs) / len(errs) if errs else None,
            "mean_predicted_s": sum(p for p, _ in pairs) / len(pairs) if pairs else None,
            "mean_observed_s": sum(o for _, o in pairs) / len(pairs) if pairs else None,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="kairos:keep=eq1;kairos", help="';'-separated policy specs")
    ap.add_argument("--rps", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals (real time)")
    ap.add_argument("--seed", type=int, default=1)
    add_harness_argument(ap)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trace = make_workload("bursty", rps=args.rps, duration_s=args.duration, seed=args.seed)
    print(f"Bursty CV 2 seed {args.seed} @ {args.rps:g} rps: {len(trace)} requests, {args.duration:g} s", flush=True)
    workroot = Path(tempfile.mkdtemp(prefix="kairos-live-keep-"))
    model_dir = build_tiny_model(workroot / "model")
    cfg = ReplayConfig(model_dir=str(model_dir), request_timeout_s=120.0)
    runs: list[dict[str, Any]] = []
    for spec in [p.strip() for p in args.policies.split(";") if p.strip()]:
        workdir = workroot / spec.replace(":", "_").replace("=", "-").replace(",", "_")
        workdir.mkdir()
        with live_cluster(spec, model_dir, 1.0, workdir, harness=args.harness) as (cluster, priority):
            run_cfg = dataclasses.replace(cfg, url=cluster.gateway_url)
            t0 = time.monotonic()
            results = replay(trace, run_cfg, stream=None)
            wall = time.monotonic() - t0
            client = redis.Redis.from_url(cluster.redis_url)
            try:
                entries = client.xrange(REDIS_TTFT_FEEDBACK_STREAM)
            finally:
                client.close()
        summary = summarize(results, run_cfg)
        paths = per_path(entries)
        overall = summary
        run = {"policy": spec, "stand_ins_priority": priority, "wall_s": wall, "feedback": paths, "replay": summary}
        runs.append(run)

        def fmt(x: float | None, f: str) -> str:
            return "-" if x is None else format(x, f)

        print(
            f"{spec:<18} keep MAPE {fmt(paths['keep']['mape'], '.3f')} (bias {fmt(paths['keep']['bias'], '+.3f')}, "
            f"n={paths['keep']['samples']}, predicted {fmt(paths['keep']['mean_predicted_s'], '.3f')} s vs observed "
            f"{fmt(paths['keep']['mean_observed_s'], '.3f')} s); deflect MAPE {fmt(paths['deflect']['mape'], '.3f')} "
            f"(n={paths['deflect']['samples']}); P95 TTFT {fmt(overall.get('p95_ttft_s'), '.3f')} s, attainment "
            f"{fmt(overall.get('slo_attainment'), '.4f')}, deflections {overall.get('deflections', '-')}",
            flush=True,
        )
    payload = {
        "trace": {"workload": "bursty", "cv": 2.0, "seed": args.seed, "rps": args.rps, "duration_s": args.duration},
        "topology": "2P2D emulated, real time",
        "harness": args.harness,
        "runs": runs,
    }
    write_result("live_keep_estimate", payload, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
