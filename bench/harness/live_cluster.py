"""The live benchmarks' cluster: a fresh local 2P2D cluster (Envoy, Redis, the dispatcher,
sidecars, emulated vLLM nodes) under one policy, with the processes that stand for other machines
at the ``--harness``'s priorities (``bench.harness.priorities.Priorities``) while it runs."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from bench.harness.priorities import FAIR_NICE_GAP, Priorities
from kairos.core.policies.kairos import gateway_settings
from kairos.launcher.local_cluster import LocalCluster, cluster_config

RESYNC_RE = re.compile(r"step loop fell .* \((\d+) times so far\)")
HARNESSES = ("fair", "shared")  # the default first


def resyncs(workdir: Path) -> int:
    """Times an emulated node's step loop fell behind the clock (from the nodes' warnings)."""
    total = 0
    for log in (workdir / "logs").glob("*-vllm.log"):
        counts = [int(m.group(1)) for m in RESYNC_RE.finditer(log.read_text(errors="replace"))]
        total += max(counts, default=0)
    return total


def stand_in_pids(cluster: LocalCluster) -> list[int]:
    """The processes that stand for other machines: each node's engine, sidecar and heartbeat
    publisher (a GPU host), and Redis."""
    procs = [p for n in cluster.nodes for p in (n.engine, n.sidecar, n.publisher) if p is not None]
    if cluster.redis is not None:
        procs.append(cluster.redis)
    return [p.pid for p in procs]


def add_harness_argument(parser: argparse.ArgumentParser) -> None:
    """``--harness``, the same for every live benchmark that runs :func:`live_cluster`."""
    parser.add_argument(
        "--harness",
        choices=HARNESSES,
        default=HARNESSES[0],
        help="fair (default): the emulated nodes, their agents and Redis SCHED_RR and the client "
        f"{FAIR_NICE_GAP} nice steps above the gateway (they stand for other machines; needs root); "
        "shared: one priority for all",
    )


@contextlib.contextmanager
def live_cluster(
    policy: str, model_dir: Path, scale: float, workdir: Path, dispatchers: int = 1, harness: str = HARNESSES[0]
) -> Iterator[tuple[LocalCluster, str]]:
    """A fresh local 2P2D cluster under ``policy`` with its heartbeats in and its stand-ins at the
    ``harness``'s priorities while it runs (``bench.harness.priorities.Priorities``); yields it and what the
    stand-ins run at, then puts the priorities back and stops every process."""
    if harness not in HARNESSES:
        raise ValueError(f"harness must be one of {HARNESSES}, got {harness!r}")
    gateway_policy, decider = gateway_settings(policy)  # a spec's decider knobs are the dispatchers' settings
    config = cluster_config(
        gateway_port=0,
        model_dir=str(model_dir),
        time_scale=scale,
        policy=gateway_policy,
        dispatchers=dispatchers,
        log_level="WARNING",
        **decider,
    )
    cluster = LocalCluster(config, workdir)
    try:
        cluster.start()
        cluster.wait_for_heartbeats(timeout_s=60.0)  # a loaded host starts a dozen processes slowly
        priorities = Priorities(stand_in_pids(cluster), "emulated nodes, their sidecars and publishers, Redis")
        priority = priorities.open_gap(FAIR_NICE_GAP if harness == "fair" else 0)
        try:
            yield cluster, priority
        finally:
            priorities.close_gap()
    finally:
        cluster.stop()
