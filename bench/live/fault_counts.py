"""Requests lost to single process faults under steady load (issue 11's fault table).

Each case runs steady open-loop traffic (``--rps``, short prompts, 4 tokens) through a local
emulated 2P2D cluster, kills one process with SIGKILL (or freezes it with SIGSTOP for the
rest of the run), keeps the traffic going for ``--after`` seconds, and counts the failed
requests: all of them, those sent more than 2 s after the fault, and when the last failure was
sent (seconds after the fault).

- ``dispatcher``: one of two dispatcher replicas (``LocalCluster``, ``dispatchers=2``).
- ``frozen-dispatcher``: the same replica, stopped (SIGSTOP) instead: it holds its connections.
- ``engine``: d1's emulated vLLM engine (its sidecar and publisher stay up).
- ``prefill-engine``: p1's emulated vLLM engine (its publisher stays up until it notices).
- ``sidecar``: d0's sidecar (its engine and publisher stay up).
- ``up-engine``: d1's engine under ``kairos up`` itself (the launcher's reaction counts).

    python -m bench.live.fault_counts [--cases dispatcher,frozen-dispatcher,engine,prefill-engine,sidecar,up-engine]
                                      [--rps 6] [--after 15]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.results import write_result
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.processes import ManagedProcess, free_port
from kairos.launcher.tinymodel import build_tiny_model
from tests.steady_load import Outcome, SteadyLoad

PROMPT = "the quick brown fox jumps over a lazy dog " * 20
CASES = ("dispatcher", "frozen-dispatcher", "engine", "prefill-engine", "sidecar", "up-engine")


def _count(outcomes: list[Outcome], killed_at: float) -> dict[str, Any]:
    failed = [o for o in outcomes if not o.ok]
    after = [o for o in outcomes if o.sent_at >= killed_at]
    return {
        "requests": len(outcomes),
        "requests_after_kill": len(after),
        "failed": len(failed),
        "failed_sent_after_kill_plus_2s": sum(1 for o in failed if o.sent_at >= killed_at + 2.0),
        "last_failure_s_after_kill": round(max(o.sent_at for o in failed) - killed_at, 2) if failed else None,
        "errors": sorted({o.error[:90] for o in failed})[:5],
    }


def _under_load(
    url: str, rps: float, after_s: float, kill: ManagedProcess | int, sig: signal.Signals = signal.SIGKILL
) -> dict[str, Any]:
    load = SteadyLoad(url, PROMPT, rps=rps).start()
    deadline = time.monotonic() + 60
    while sum(o.ok for o in load.outcomes) < 2 * rps and time.monotonic() < deadline:  # warm: ~2 s served
        time.sleep(0.1)
    # A process the cluster started leads its own process group: signal all of it.
    send = (lambda s: os.killpg(kill.pid, s)) if isinstance(kill, ManagedProcess) else (lambda s: os.kill(kill, s))
    killed_at = time.monotonic()
    send(sig)
    try:
        time.sleep(after_s)
        return _count(load.stop(), killed_at)
    finally:
        if sig == signal.SIGSTOP:
            send(signal.SIGCONT)  # so that the cluster stops as usual


def _cluster_case(case: str, workdir: Path, model_dir: Path, rps: float, after_s: float) -> dict[str, Any]:
    config = LocalClusterConfig(gateway_port=0, model_dir=str(model_dir), time_scale=5, dispatchers=2)
    cluster = LocalCluster(config, workdir / case)
    try:
        cluster.start()
        cluster.wait_for_heartbeats(60)
        victim = {
            "dispatcher": cluster.dispatcher_procs[0],
            "frozen-dispatcher": cluster.dispatcher_procs[0],
            "engine": cluster.node("d1").engine,
            "prefill-engine": cluster.node("p1").engine,
            "sidecar": cluster.node("d0").sidecar,
        }[case]
        assert victim is not None
        sig = signal.SIGSTOP if case.startswith("frozen") else signal.SIGKILL
        return _under_load(cluster.gateway_url, rps, after_s, victim, sig)
    finally:
        cluster.stop()


def _up_case(workdir: Path, model_dir: Path, rps: float, after_s: float) -> dict[str, Any]:
    port = free_port()
    up_dir = workdir / "up"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kairos.launcher.cli",
            "up",
            "--port",
            str(port),
            "--workdir",
            str(up_dir),
            "--model-dir",
            str(model_dir),
            "--time-scale",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "curl " in line:
                break
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
        engine = next(
            int(line.split()[0])
            for line in out.splitlines()
            if "emulated_vllm" in line and "--node-id d1 " in line and str(model_dir) in line
        )
        return _under_load(f"http://127.0.0.1:{port}", rps, after_s, engine)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rps", type=float, default=6.0)
    ap.add_argument("--after", type=float, default=15.0, help="seconds of traffic after the kill")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kairos-faults-"))
    model_dir = build_tiny_model(workdir / "model")
    results: dict[str, Any] = {"rps": args.rps, "after_s": args.after, "cases": {}}
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r}; one of {list(CASES)}")
        if case == "up-engine":
            figures = _up_case(workdir, model_dir, args.rps, args.after)
        else:
            figures = _cluster_case(case, workdir, model_dir, args.rps, args.after)
        results["cases"][case] = figures
        print(
            f"{case:>10}: {figures['failed']:3d} of {figures['requests_after_kill']:3d} sent after the kill failed "
            f"({figures['failed_sent_after_kill_plus_2s']} sent > 2 s after it; last failure sent "
            f"{figures['last_failure_s_after_kill']} s after it) {figures['errors'][:2]}",
            flush=True,
        )
    write_result("fault_counts", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
