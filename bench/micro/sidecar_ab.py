"""The decode-node sidecar of a git ref (A) against this tree's (B), paired, in one run.

One emulated 1P1D cluster (``bench/micro/gateway_overhead.py``'s: nodes at ``time_scale`` 1000), and two
extra sidecars in front of its decode node: A runs the code of ``--base`` (a git ref, extracted
with ``git archive``), B this working tree's. Both get the same nodes, Redis (TTFT feedback on:
the requests carry the dispatcher's prediction) and settings. Each round sends one keep request
(the P/D path: hop 1 to the prefill node, hop 2 to the decode node) on every path, the order
reversed every other round (ABBA...), so drift and other processes' load fall on A and B alike;
the comparison is the median of the per-round differences B - A, beside each path's percentiles
and each sidecar's CPU per request (utime + stime from /proc over the measured rounds).

With ``--gateway`` each sidecar also gets the Kairos Envoy config + the no-op ext_proc in front
of it (setting the keep headers), and the run adds ``direct`` (the decode node's port) and
``noop_direct`` (the same Envoy + no-op in front of the decode node): gateway_overhead's
"gateway on the longer path", ``(noop_gateway - sidecar) - (noop_direct - direct)``, for A and B.

Every request carries the SLO headers the dispatcher sets (the SLOs it decided by, the class). With
``--stream-tokens N`` the requests stream N tokens (the sidecar's per-chunk relay, where it notes
each token chunk's arrival for the request's SLO judgement) instead of one JSON answer of one.

    python -m bench.micro.sidecar_ab [--base main] [--requests 600] [--size 2048] [--stream-tokens N] [--gateway]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.bodies import completion_body
from bench.harness.priorities import CpuMeter
from bench.harness.results import write_result
from bench.harness.waiting import wait_until
from bench.micro.gateway_overhead import (
    HOST,
    PathRunner,
    cluster_config,
    hostport,
    keep_headers,
    plain_path,
    serves,
    start_noop_gateway,
)
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster
from kairos.launcher.processes import ManagedProcess, ProcessGroup, free_port, tcp_ready

ROOT = Path(__file__).resolve().parents[2]

WARMUP_ROUNDS = 30
# What the dispatcher adds to every routed request since per-request SLOs (issue 33): the SLOs it
# decided by and the request's class (here the cluster's defaults).
SLO_HEADERS = ((c.H_DECIDED_TTFT_SLO_MS, "4000"), (c.H_DECIDED_TPOT_SLO_MS, "70"), (c.H_SLO_CLASS, "standard"))
# The installed package's folders (pyproject's package-dir): kairos/ holds the rest.
SUBPACKAGES = ("nodeagent", "extproc", "sim", "profiling")


def extract_ref(ref: str, dest: Path) -> Path:
    """The ``kairos`` package of git ``ref`` laid out as installed, importable from ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    folders = ("kairos", *SUBPACKAGES)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *folders], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for name in SUBPACKAGES:
        (dest / "kairos" / name).symlink_to(dest / name, target_is_directory=True)
    return dest


def start_sidecar(
    group: ProcessGroup,
    workdir: Path,
    name: str,
    code_root: Path | None,
    decode: str,
    prefill: str,
    env: dict[str, str],
) -> tuple[ManagedProcess, tuple[str, int]]:
    """A sidecar for ``decode`` from ``code_root`` (an :func:`extract_ref` tree; None: this tree)."""
    port = free_port()
    extra = {} if code_root is None else {"PYTHONPATH": str(code_root)}  # ahead of the editable install
    proc = group.start(
        ManagedProcess(
            name,
            [
                sys.executable,
                "-m",
                "kairos.nodeagent.sidecar",
                "--host",
                HOST,
                "--port",
                str(port),
                "--local-vllm",
                decode,
                "--allow-prefill",
                prefill,
                "--log-level",
                "WARNING",
            ],
            workdir / f"{name}.log",
            ready=tcp_ready(HOST, port),
            env={**env, **extra},
            cwd=code_root or ROOT,
        ),
        timeout_s=60,
    )
    return proc, (HOST, port)


def stats(samples_ms: list[float]) -> dict[str, float]:
    a = np.asarray(samples_ms)
    return {f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"mean_ms": float(a.mean())}


async def measure(paths: list[PathRunner], rounds: int) -> dict[str, list[float]]:
    """One request per path per round, the order reversed every other round."""
    out: dict[str, list[float]] = {p.name: [] for p in paths}
    for i in range(rounds):
        for p in paths if i % 2 == 0 else paths[::-1]:
            ns, _ = await p.send()
            out[p.name].append(ns / 1e6)
    return out


def request_body(size: int, stream_tokens: int) -> bytes:
    """The keep request's body: one JSON answer of one token, or a stream of ``stream_tokens``."""
    body = completion_body(size, seed=1)
    if not stream_tokens:
        return body
    return json.dumps(json.loads(body) | {"max_tokens": stream_tokens, "stream": True}).encode()


def run(args: argparse.Namespace) -> dict[str, Any]:
    body = request_body(args.size, args.stream_tokens)
    with tempfile.TemporaryDirectory(prefix="kairos-sidecar-ab-") as tmp, ProcessGroup() as group:
        workdir = Path(tmp)
        base_root = extract_ref(args.base, workdir / "base")
        with LocalCluster(cluster_config("pd"), workdir / "pd") as pd:
            pd.wait_for_heartbeats()
            prefill, decode = pd.node("p0").url, pd.node("d0").url
            env = pd.agent_env(pd.node("d0"))
            procs, sidecars = {}, {}
            for k, code_root in (("A", base_root), ("B", None)):
                procs[k], sidecars[k] = start_sidecar(group, workdir, f"sidecar-{k}", code_root, decode, prefill, env)
            keep = (*keep_headers(prefill), *SLO_HEADERS)
            targets: dict[str, tuple[tuple[str, int], tuple[tuple[str, str], ...]]] = {
                f"sidecar_{k}": (hp, keep) for k, hp in sidecars.items()
            }
            if args.gateway:
                targets["direct"] = (hostport(decode), ())
                targets["noop_direct"] = (start_noop_gateway(group, workdir, "noop", decode), ())
                for k, (h, p) in sidecars.items():
                    targets[f"gateway_{k}"] = (start_noop_gateway(group, workdir, f"noop-{k}", f"{h}:{p}", keep), ())
                for name in ("noop_direct", "gateway_A", "gateway_B"):
                    wait_until(serves(targets[name][0], body), 60, f"{name} to serve a completion")
            meter = CpuMeter({k: proc.pid for k, proc in procs.items()})

            async def go() -> tuple[dict[str, list[float]], dict[str, float], dict[str, float], float]:
                paths = [await plain_path(name, hp, body, headers) for name, (hp, headers) in targets.items()]
                try:
                    await measure(paths, WARMUP_ROUNDS)  # connections, pools, caches
                    before, t0 = meter.snapshot(), time.monotonic()
                    samples = await measure(paths, args.requests)
                    return samples, before, meter.snapshot(), time.monotonic() - t0
                finally:
                    for p in paths:
                        await p.close()

            load_before = os.getloadavg()
            samples, cpu0, cpu1, wall = asyncio.run(go())
    per_sidecar = (1 + args.gateway) * args.requests  # requests each sidecar served while measured
    result: dict[str, Any] = {
        "config": {
            "base": args.base,
            "requests": args.requests,
            "body_bytes": len(body),
            "stream_tokens": args.stream_tokens,
            "gateway": args.gateway,
        },
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "wall_s": wall,
        "paths": {name: stats(s) for name, s in samples.items()},
        "cpu_ms_per_request": {k: (cpu1[k] - cpu0[k]) / per_sidecar * 1e3 for k in ("A", "B")},
        "paired_median_B_minus_A_ms": {},
    }
    for kind in ("sidecar", "gateway"):
        if f"{kind}_A" in samples:
            diff = np.asarray(samples[f"{kind}_B"]) - np.asarray(samples[f"{kind}_A"])
            result["paired_median_B_minus_A_ms"][kind] = float(np.median(diff))
    if args.gateway:
        p50 = {name: s["p50_ms"] for name, s in result["paths"].items()}
        floor = p50["noop_direct"] - p50["direct"]
        result["gateway_on_longer_path_p50_ms"] = {
            k: p50[f"gateway_{k}"] - p50[f"sidecar_{k}"] - floor for k in ("A", "B")
        }
    return result


def report(result: dict[str, Any]) -> None:
    cfg, load = result["config"], result["load_average_1_5_15"]
    answer = f"a stream of {cfg['stream_tokens']} tokens" if cfg.get("stream_tokens") else "one JSON answer"
    print(
        f"A = {cfg['base']}, B = this tree; {cfg['requests']} rounds, {cfg['body_bytes']} B body, {answer}, "
        f"load {load['before'][0]:.1f} -> {load['after'][0]:.1f}"
    )
    print(f"  {'path':<12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, s in result["paths"].items():
        print(f"  {name:<12} {s['p50_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['mean_ms']:>8.3f}")
    cpu = result["cpu_ms_per_request"]
    print(f"  sidecar CPU per request: A {cpu['A']:.3f} ms, B {cpu['B']:.3f} ms")
    for kind, d in result["paired_median_B_minus_A_ms"].items():
        print(f"  paired median B - A ({kind}): {d:+.3f} ms")
    for k, v in result.get("gateway_on_longer_path_p50_ms", {}).items():
        print(f"  gateway on the longer path, p50, {k}: {v:+.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git ref of sidecar A (default main)")
    parser.add_argument("--requests", type=int, default=600, help="measured rounds (one request per path each)")
    parser.add_argument("--size", type=int, default=2048, help="request body bytes (default 2048)")
    parser.add_argument(
        "--stream-tokens", type=int, default=0, help="stream this many tokens per request (default 0: one JSON answer)"
    )
    parser.add_argument("--gateway", action="store_true", help="also through Envoy + the no-op ext_proc")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    report(result)
    if args.json is not None:
        write_result("sidecar_ab", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
