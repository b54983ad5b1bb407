"""Shared helpers for the benchmark scripts: percentile summaries, JSON output, the stand-ins'
priorities ("fair" harness), CPU accounting of processes, Prometheus histogram scrapes, and
waiting for servers."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=float) / 1e3
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
        "samples": int(a.size),
    }


def write_result(name: str, payload: dict[str, Any], out: Path | None = None) -> Path:
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


# ---------------------------------------------------------------------------------------------
# Harnesses: stand-ins for other machines above the gateway on shared cores
# ---------------------------------------------------------------------------------------------
FAIR_NICE_GAP = 10  # nice steps between the stand-ins (and the load generator) and the gateway


def harness_name(gateway_nice: int) -> str:
    return "fair" if gateway_nice > 0 else "shared"


class Priorities:
    """CPU priorities of the stand-ins for other machines (bench/scale.py: the publishers, Redis
    and the upstream; bench/e2e_replay.py: the emulated nodes, their agents and Redis) and of this
    process (the load generator), above the gateway (Envoy, the dispatchers). Nice steps alone do not
    keep them from waiting for the gateway's CPUs on this kernel (6.18, EEVDF: a nice -10 process
    woke 48-51 ms late at p99 beside six busy loops on 2 cores), so where allowed (root) they also
    run SCHED_RR, which always runs before any normal process and is bounded by the kernel's
    real-time throttling (95% of each second): they use a few percent of a core each. Not this
    process: it starts the gateway, which must not inherit a real-time policy."""

    def __init__(self, stand_ins: list[int], label: str) -> None:
        self.started = stand_ins  # the processes this benchmark started that stand for other machines
        self.label = label  # what they are, for the record
        self.stand_ins = [0, *stand_ins]  # 0: this process (its main thread, the load generator's)
        self.base = os.getpriority(os.PRIO_PROCESS, 0)

    def _set(self, nice: int) -> None:
        for pid in self.stand_ins:
            with contextlib.suppress(ProcessLookupError):  # one that died is reported by its own check
                os.setpriority(os.PRIO_PROCESS, pid, nice)

    def _set_policy(self, policy: int, priority: int) -> None:
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(pid, policy, os.sched_param(priority))

    def open_gap(self, gap: int) -> str:
        """Raise the stand-ins ``gap`` nice steps, and to SCHED_RR, as far as allowed; what they
        run at. A gateway already running keeps its priority; one started after this from this
        process needs ``nice -n gap`` to get it back (it inherits this process's nice value)."""
        try:
            self._set(max(-20, self.base - gap))
        except PermissionError:
            self._set(self.base)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if gap <= 0:
            return f"nice {nice}"
        try:
            self._set_policy(os.SCHED_RR | os.SCHED_RESET_ON_FORK, 1)
        except PermissionError:
            return f"nice {nice}"
        return f"nice {nice}; {self.label} SCHED_RR"

    def close_gap(self) -> None:
        self._set_policy(os.SCHED_OTHER, 0)
        self._set(self.base)


# ---------------------------------------------------------------------------------------------
# CPU accounting (Linux /proc)
# ---------------------------------------------------------------------------------------------
class CpuMeter:
    """CPU seconds of named processes (all their threads) and of the whole machine."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def _proc(self, pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime

    def _machine(self) -> tuple[float, float]:
        """(busy, total) CPU seconds of all cores since boot."""
        try:
            values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except OSError:
            return float("nan"), float("nan")
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already inside user/nice
        return (total - idle) / self.tick, total / self.tick

    def snapshot(self) -> dict[str, float]:
        busy, total = self._machine()
        return {**{name: self._proc(pid) for name, pid in self.pids.items()}, "machine_busy": busy, "machine": total}

    @staticmethod
    def cores_used(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
        """Average cores each process used over ``wall_s``; ``machine_busy`` counts every process,
        other people's included; ``other`` is the machine's busy cores not in the named ones."""
        used = {k: round((after[k] - before[k]) / wall_s, 3) for k in before if k != "machine"}
        named = sum(v for k, v in used.items() if k != "machine_busy")
        used["other"] = round(used["machine_busy"] - named, 3)
        return used


# ---------------------------------------------------------------------------------------------
# Dispatcher metrics
# ---------------------------------------------------------------------------------------------
def scrape_histogram(metrics_url: str, name: str) -> dict[str, float]:
    """``{"le=<bound>": cumulative count, ..., "sum": s, "count": n}`` of one unlabelled histogram."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[f"le={le}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum "):
            out["sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count "):
            out["count"] = float(line.rsplit(" ", 1)[1])
    return out


def scrape_counters(metrics_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Every sample of the metrics ``names``, keyed by its series (``name{labels}``)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        series: float(value)
        for series, _, value in (line.rpartition(" ") for line in text.splitlines())
        if series.split("{", 1)[0] in names
    }


def scrape_decisions(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kairos_dispatcher_decisions_total{")
    }


def histogram_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean and bucket-interpolated p50/p99 (ms) of the observations between two scrapes."""
    count = after.get("count", 0.0) - before.get("count", 0.0)
    if count <= 0:
        return {"count": 0}
    bounds = sorted(
        (float(k[3:]), after[k] - before.get(k, 0.0)) for k in after if k.startswith("le=") and k != "le=+Inf"
    )

    def quantile(q: float) -> tuple[float | None, str]:
        """(interpolated value, "(lo, hi] ms" bucket it falls in); None above the last bound."""
        rank = q * count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cum in bounds:
            if cum >= rank:
                span = cum - lower_count
                frac = (rank - lower_count) / span if span > 0 else 1.0
                value = (lower_bound + frac * (bound - lower_bound)) * 1e3
                return value, f"({lower_bound * 1e3:g}, {bound * 1e3:g}] ms"
            lower_bound, lower_count = bound, cum
        return None, f"> {lower_bound * 1e3:g} ms"

    p50, p50_bucket = quantile(0.50)
    p99, p99_bucket = quantile(0.99)
    return {
        "count": int(count),
        "mean_ms": (after["sum"] - before.get("sum", 0.0)) / count * 1e3,
        "p50_ms_from_buckets": p50,
        "p50_bucket": p50_bucket,
        "p99_ms_from_buckets": p99,
        "p99_bucket": p99_bucket,
        "buckets_le_s": {k[3:]: int(after[k] - before.get(k, 0.0)) for k in after if k.startswith("le=")},
    }


# ---------------------------------------------------------------------------------------------
# Waiting for servers
# ---------------------------------------------------------------------------------------------
def wait_until(probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")
