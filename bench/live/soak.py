"""Soak: a local cluster (Envoy, Redis, dispatchers, sidecars, publishers, emulated 2P2D nodes)
under open-loop streaming Bursty traffic for a long stretch (10 minutes by default), sampling
every process's resident memory and open file descriptors, Redis's memory, key count and the
TTFT-feedback stream's length, so that a leak shows as growth rather than as an outage days
later.

Each process is measured with its descendants (a process group's whole tree). Growth is the
least-squares slope over the samples after a warm-up (the first 20% of the run: caches, pools
and the feedback stream's window fill there), in MiB or fds per minute; the table also gives
the first post-warm-up, last and largest values. Every request's outcome is counted: the soak
is also a check that nothing is lost when nothing goes wrong.

    python -m bench.live.soak [--duration-s 600] [--rps 4] [--time-scale 1] [--dispatchers 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import redis
from bench.harness.results import write_result
from kairos.common.contracts import REDIS_TTFT_FEEDBACK_STREAM
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.replay import ReplayConfig, RequestResult, replay, requests_for

WARMUP_FRACTION = 0.2
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # it exited while we looked
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces
        children[ppid].append(int(entry))
    return children


def _tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _rss_and_fds(pids: list[int]) -> tuple[float, int]:
    rss_pages, fds = 0, 0
    for pid in pids:
        try:
            rss_pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return rss_pages * PAGE_BYTES / MIB, fds


@dataclass
class Series:
    """One measured quantity over the run: (elapsed s, value) samples."""

    unit: str
    samples: list[tuple[float, float]] = field(default_factory=list)

    def summary(self, warmup_s: float) -> dict[str, float | None]:
        after = [(t, v) for t, v in self.samples if t >= warmup_s] or self.samples
        if not after:
            return {"first": None, "last": None, "max": None, "slope_per_min": None}
        t = np.array([s[0] for s in after])
        v = np.array([s[1] for s in after])
        slope = float(np.polyfit(t / 60.0, v, 1)[0]) if len(after) >= 3 and np.ptp(t) > 0 else 0.0
        return {"first": float(v[0]), "last": float(v[-1]), "max": float(v.max()), "slope_per_min": slope}


class Sampler:
    """Samples every managed process of ``cluster`` and its Redis every ``period_s``."""

    def __init__(self, cluster: LocalCluster, period_s: float) -> None:
        self.cluster = cluster
        self.period_s = period_s
        self.series: dict[str, dict[str, Series]] = {}
        self.redis = redis.Redis.from_url(cluster.redis_url, socket_timeout=5.0)
        self._stop = threading.Event()
        self._t0 = time.monotonic()

    def _put(self, owner: str, key: str, unit: str, t: float, value: float) -> None:
        self.series.setdefault(owner, {}).setdefault(key, Series(unit)).samples.append((t, value))

    def sample(self) -> None:
        t = time.monotonic() - self._t0
        children = _children_by_parent()
        for proc in self.cluster.group.procs:
            if not proc.alive():
                continue
            rss, fds = _rss_and_fds(_tree(proc.pid, children))
            self._put(proc.name, "rss", "MiB", t, rss)
            self._put(proc.name, "fds", "fds", t, fds)
        try:
            memory = self.redis.info("memory")
            self._put("redis-server (data)", "used_memory", "MiB", t, memory["used_memory"] / MIB)
            self._put("redis-server (data)", "keys", "keys", t, float(self.redis.dbsize()))
            stream_length = float(self.redis.xlen(REDIS_TTFT_FEEDBACK_STREAM))
            self._put("redis-server (data)", "feedback_stream", "entries", t, stream_length)
        except redis.RedisError as exc:
            print(f"redis sample failed: {exc}", file=sys.stderr)

    def run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def outcome_counts(results: list[RequestResult]) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for r in results:
        counts["sent"] += 1
        if r.ok:
            counts["ok"] += 1
        else:
            counts[f"failed status={r.status}"] += 1
    return dict(counts)


def format_table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [f"{'process':<28} {'measure':<26} {'first':>9} {'last':>9} {'max':>9} {'slope/min':>10}"]
    for owner, measures in summary.items():
        for key, s in measures.items():
            if s["first"] is None:
                continue
            lines.append(
                f"{owner:<28} {key + ' (' + s['unit'] + ')':<26} {s['first']:>9.1f} {s['last']:>9.1f} "
                f"{s['max']:>9.1f} {s['slope_per_min']:>+10.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=600.0, help="wall seconds of traffic")
    ap.add_argument("--rps", type=float, default=4.0, help="arrival rate in model requests per second")
    ap.add_argument("--time-scale", type=float, default=1.0, help="emulated nodes' speed-up over real time")
    ap.add_argument("--dispatchers", type=int, default=2)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="output path (default bench/results/soak.json)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kairos-soak-") as tmp:
        config = LocalClusterConfig(gateway_port=0, dispatchers=args.dispatchers, time_scale=args.time_scale)
        with LocalCluster(config, Path(tmp)) as cluster:
            cluster.wait_for_heartbeats()
            replay_config = ReplayConfig(
                url=cluster.gateway_url,
                model_dir=str(cluster.model_dir),
                rps=args.rps,
                duration_s=args.duration_s * args.time_scale,
                seed=args.seed,
                time_scale=args.time_scale,
            )
            requests = requests_for(replay_config)
            sampler = Sampler(cluster, args.sample_s)
            sampler.sample()
            thread = threading.Thread(target=sampler.run, daemon=True)
            thread.start()
            started = time.monotonic()
            try:
                results = replay(requests, replay_config, stream=None)
            finally:
                sampler.stop()
                thread.join()
            sampler.sample()
            wall_s = time.monotonic() - started

    warmup_s = WARMUP_FRACTION * wall_s
    summary = {
        owner: {key: {"unit": s.unit, **s.summary(warmup_s)} for key, s in measures.items()}
        for owner, measures in sampler.series.items()
    }
    outcomes = outcome_counts(results)
    print(
        f"soak: {wall_s:.0f} s of traffic at {args.rps:g} model rps (time scale {args.time_scale:g}), "
        f"{args.dispatchers} dispatchers; requests: {outcomes}"
    )
    print(f"growth is the slope after the first {warmup_s:.0f} s (warm-up)")
    print(format_table(summary))
    write_result(
        "soak",
        {
            "duration_s": args.duration_s,
            "wall_s": wall_s,
            "rps": args.rps,
            "time_scale": args.time_scale,
            "dispatchers": args.dispatchers,
            "warmup_s": warmup_s,
            "requests": outcomes,
            "processes": summary,
            "samples": {
                owner: {key: s.samples for key, s in measures.items()} for owner, measures in sampler.series.items()
            },
        },
        args.json,
    )
    return 0 if outcomes.get("ok", 0) == outcomes.get("sent", 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
