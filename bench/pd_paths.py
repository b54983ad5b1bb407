"""Latency the routers add on the P/D and deflect paths, over emulated vLLM nodes whose compute
is about zero (``time_scale`` 1000), side by side in one run.

Two emulated 1P1D clusters from ``LocalCluster``: one whose dispatcher keeps every request on
the P/D path (``--policy pd``), one whose dispatcher deflects every request (``sl`` with a
length limit above any prompt here). Paths, each a sequential keep-alive client sending
non-streaming completions with ``max_tokens`` 1, interleaved in rotating blocks:

- ``direct``: straight to the P/D cluster's decode node's vLLM port (no prefill hop, no KV pull);
- ``router_pd``: vLLM's Rust router in its P/D mode (``vllm-router --vllm-pd-disaggregation``)
  in front of the same prefill and decode nodes, when its binary is found (``--router``, else
  ``.venv-router/bin/vllm-router``, built by ``scripts/router_env.sh``; never a Kairos
  dependency);
- ``kairos_pd``: Envoy + dispatcher + sidecar on the P/D path, same nodes;
- ``kairos_deflect``: Envoy + dispatcher + sidecar, the decode node prefilling itself.

Both P/D routers pay the same node-side costs (the prefill hop and the KV pull); the added time
over ``direct`` is what each router costs, with those node costs in. The deflect path skips the
prefill hop and the pull. Prompts: about 2 KB and 100 KB of text.

    python bench/pd_paths.py [--requests 300] [--router PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import percentiles_us, wait_until, write_result  # noqa: E402
from bench.gateway_overhead import completion_body  # noqa: E402
from bench.loadgen import HttpConnection, build_request, post_once  # noqa: E402
from kairos.common import contracts as c  # noqa: E402
from kairos.extproc.cluster import ClusterViewConfig  # noqa: E402
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig  # noqa: E402
from kairos.launcher.processes import ManagedProcess, ProcessGroup, free_port, tcp_ready  # noqa: E402

HOST = "127.0.0.1"
BODY_SIZES = {"2KB": 2 * 1024, "100KB": 100 * 1024}
TIME_SCALE = 1000.0
DEFLECT_EVERYTHING = "sl:l=1000000"  # deflect any prompt up to a million tokens
DEFAULT_ROUTER = ROOT / ".venv-router" / "bin" / "vllm-router"
RESERVATION_S = ClusterViewConfig().reservation_ttl_s


def find_router(given: str | None) -> str | None:
    if given:
        return given
    if DEFAULT_ROUTER.exists():
        return str(DEFAULT_ROUTER)
    return shutil.which("vllm-router")


def hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def check_path(name: str, host: str, port: int, body: bytes, want_route: str | None) -> dict[str, str]:
    """One request: 200, and on a Kairos path the route the dispatcher says it took."""
    resp = await post_once(host, port, "/v1/completions", body)
    if resp.status != 200:
        raise RuntimeError(f"{name}: status {resp.status}: {resp.body[:300]!r}")
    route = resp.headers.get(c.H_ROUTE.lower(), "-")
    if want_route is not None and route != want_route:
        raise RuntimeError(f"{name}: route {route!r}, expected {want_route!r}")
    return {"route": route}


async def timed_requests(
    conn: HttpConnection, request: bytes, n: int, want_route: str | None, pace_s: float
) -> tuple[list[int], int]:
    """``n`` requests one after the other: their latencies (ns) and how many took another route
    than ``want_route`` (those are not timed). ``pace_s`` apart, counted from each answer."""
    samples, off_route = [], 0
    for _ in range(n):
        if pace_s:
            await asyncio.sleep(pace_s)
        t0 = time.perf_counter_ns()
        resp = await conn.send(request)
        elapsed = time.perf_counter_ns() - t0
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {resp.body[:300]!r}")
        if want_route is not None and resp.headers.get(c.H_ROUTE.lower()) != want_route:
            off_route += 1
        else:
            samples.append(elapsed)
    return samples, off_route


async def measure(
    targets: dict[str, tuple[str, int]],
    expected: dict[str, str | None],
    paced: dict[str, float],
    body: bytes,
    n: int,
    block: int,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """``n`` requests per path in blocks of ``block``, the paths' order rotating each round."""
    conns = {p: await HttpConnection.open(*hp) for p, hp in targets.items()}
    requests = {p: build_request(hp[0], hp[1], "/v1/completions", body) for p, hp in targets.items()}
    paths = list(targets)
    samples: dict[str, list[int]] = {p: [] for p in paths}
    off_route = dict.fromkeys(paths, 0)
    try:
        for p in paths:  # warm-up: connections, pools, caches
            await timed_requests(conns[p], requests[p], 3, None, paced.get(p, 0.0))
        for round_no in range(-(-n // block)):
            k = min(block, n - round_no * block)
            first = round_no % len(paths)
            for p in paths[first:] + paths[:first]:
                got, off = await timed_requests(conns[p], requests[p], k, expected[p], paced.get(p, 0.0))
                samples[p].extend(got)
                off_route[p] += off
    finally:
        for conn in conns.values():
            await conn.close()
    return samples, off_route


def stats_ms(samples_ns: list[int]) -> dict[str, float]:
    got = percentiles_us(samples_ns)
    return {"p50_ms": got["p50_us"] / 1e3, "p99_ms": got["p99_us"] / 1e3, "samples": got["samples"]}


def cluster_config(policy: str) -> LocalClusterConfig:
    return LocalClusterConfig(
        prefill_nodes=1,
        decode_nodes=1,
        dispatchers=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        policy=policy,
        log_level="WARNING",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    router_bin = find_router(args.router)
    bodies = {label: completion_body(size, seed=i + 1) for i, (label, size) in enumerate(BODY_SIZES.items())}
    with tempfile.TemporaryDirectory(prefix="kairos-pdbench-") as tmp, ProcessGroup() as router_group:
        workdir = Path(tmp)
        pd = LocalCluster(cluster_config("pd"), workdir / "pd")
        deflect = LocalCluster(cluster_config(DEFLECT_EVERYTHING), workdir / "deflect")
        with pd, deflect:
            for cluster in (pd, deflect):
                cluster.wait_for_heartbeats()
            targets = {
                "direct": hostport(pd.node("d0").url),
                "kairos_pd": hostport(pd.gateway_url),
                "kairos_deflect": hostport(deflect.gateway_url),
            }
            expected: dict[str, str | None] = {"direct": None, "kairos_pd": "keep", "kairos_deflect": "deflect"}
            if router_bin is not None:
                port = free_port()
                router_group.start(
                    ManagedProcess(
                        "vllm-router",
                        [
                            router_bin,
                            "--host",
                            HOST,
                            "--port",
                            str(port),
                            "--vllm-pd-disaggregation",
                            "--prefill",
                            f"http://{pd.node('p0').url}",
                            "--decode",
                            f"http://{pd.node('d0').url}",
                            "--log-level",
                            "warning",
                        ],
                        workdir / "router.log",
                        ready=tcp_ready(HOST, port),
                    ),
                    timeout_s=60,
                )
                targets = {
                    "direct": targets["direct"],
                    "router_pd": (HOST, port),
                    **{k: v for k, v in targets.items() if k != "direct"},
                }
                expected["router_pd"] = None

                def router_serves() -> bool:
                    try:
                        asyncio.run(check_path("router_pd", HOST, port, bodies["2KB"], None))
                    except (OSError, RuntimeError):
                        return False
                    return True

                wait_until(router_serves, 60, "vllm-router to serve a completion")
            # A deflection holds its decode node's reservation for 3 heartbeat periods: one request
            # per reservation, so that every timed one deflects (the others are counted off_route).
            paced = {"kairos_deflect": RESERVATION_S + 0.05}
            load_before = os.getloadavg()
            checks: dict[str, dict[str, dict[str, str]]] = {}
            for label, body in bodies.items():
                checks[label] = {}
                for p in targets:
                    time.sleep(paced.get(p, 0.0))  # the last deflection's reservation lapses
                    checks[label][p] = asyncio.run(check_path(p, *targets[p], body, expected[p]))
            latency: dict[str, Any] = {}
            for label, body in bodies.items():
                n = args.requests if label == "2KB" else max(50, args.requests // 2)
                started = time.monotonic()
                samples, off_route = asyncio.run(measure(targets, expected, paced, body, n, block=25))
                paths = {p: {**stats_ms(s), "off_route": off_route[p]} for p, s in samples.items()}
                base = paths["direct"]
                added = {
                    p: {"p50_ms": s["p50_ms"] - base["p50_ms"], "p99_ms": s["p99_ms"] - base["p99_ms"]}
                    for p, s in paths.items()
                    if p != "direct"
                }
                latency[label] = {
                    "body_bytes": len(body),
                    "requests_per_path": n,
                    "wall_s": time.monotonic() - started,
                    "paths": paths,
                    "added_over_direct": added,
                }
                print_latency(label, latency[label])
            load_after = os.getloadavg()
    return {
        "config": {
            "time_scale": TIME_SCALE,
            "requests_2KB": args.requests,
            "requests_100KB": max(50, args.requests // 2),
            "router": router_bin or "not found (scripts/router_env.sh builds .venv-router)",
            "cores": os.cpu_count(),
        },
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "path_checks": checks,
        "latency": latency,
        "notes": [
            "Sequential non-streaming completions, max_tokens 1, one keep-alive connection per path, paths "
            "interleaved in blocks of 25 with rotating order; added = difference of percentiles.",
            "kairos_deflect is paced: one request per reservation period (a deflection holds its decode node's "
            "reservation for 3 heartbeat periods), so each timed request deflects; off_route counts the ones "
            "that did not (not timed). Its added time is therefore measured on an idle connection each time.",
            "Everything shares this machine's cores: the client, both clusters (emulated nodes, sidecars, "
            "publishers, dispatchers, Envoys, Redis) and the router.",
        ],
    }


def print_latency(label: str, row: dict[str, Any]) -> None:
    print(f"\n{label} body ({row['body_bytes']} bytes), {row['requests_per_path']} sequential requests per path")
    print(f"  {'path':<16} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}")
    for p, s in row["paths"].items():
        a = row["added_over_direct"].get(p, {"p50_ms": 0.0, "p99_ms": 0.0})
        print(f"  {p:<16} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {a['p50_ms']:>+10.2f} {a['p99_ms']:>+10.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential 2 KB requests per path (100 KB: half)")
    parser.add_argument("--router", help="the vllm-router binary (default: .venv-router/bin/vllm-router or PATH)")
    parser.add_argument("--json", type=Path, help="output path (default bench/results/pd_paths.json)")
    args = parser.parse_args()
    write_result("pd_paths", run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
