"""The request path, measured to its parts: what Envoy, the ext_proc dispatcher and the sidecar's
hops each add on the P/D and deflect paths, beside vLLM's Rust router, over the same emulated
nodes, in one run.

Three emulated 1P1D clusters from ``LocalCluster`` (nodes at ``time_scale`` 1000, so their
compute is about zero; prefix caching on and their KV events published, as vLLM's defaults and
the cluster's): one whose dispatcher keeps every request on the P/D path prefix-aware (``--policy
pd``: each prompt parsed to its token ids, hashed into vLLM's blocks and looked up in the nodes'
indexes), one the same but cache-blind (``pd:prefix=off``: the prompt only counted), and one
whose dispatcher deflects every request (``sl`` with a length limit above any prompt here, a
cache-blind policy). Each path sends one body again and again, so after the first request the
prefill and decode nodes hold the whole prompt and each lookup walks (and hashes) every block of
it: the prefix path's worst case. Beside them: a minimal Envoy (listener -> router -> the decode node), the Kairos Envoy
config in front of the no-op ext_proc server (``bench/harness/noop_extproc.py``: the real gRPC service
with nothing to decide) routing to the decode node, and vLLM's Rust router in its P/D mode
(``vllm-router --vllm-pd-disaggregation``; ``--router``, else ``.venv-router/bin/vllm-router``,
built by ``scripts/router_env.sh`` into the benchmark's own environment, never a Kairos
dependency). Paths, each a sequential keep-alive client sending non-streaming completions with
``max_tokens`` 1 (about 2 KB and 100 KB of text), interleaved in rotating blocks:

- ``direct``: the P/D cluster's decode node's vLLM port (one hop, no prefill, no KV pull);
- ``direct_deflect``: the deflect cluster's decode node's vLLM port, the body carrying the chunk
  schedule the dispatcher chose (``vllm_xargs``), as the sidecar sends it: the node's own cost
  of a deflected prefill;
- ``client_pd``: this client doing the P/D hand-off itself (prefill node with
  ``do_remote_decode``, then the decode node with the reply's ``kv_transfer_params``): the
  nodes' own P/D cost, with no router;
- ``envoy``: Envoy alone in front of the decode node;
- ``envoy_noop_extproc``: the Kairos Envoy config + the no-op ext_proc, to the decode node: the
  floor of Envoy's ext_proc filter and its round trips (the one-message route: the body alone);
- ``envoy_noop_two_messages``: the same, each request carrying a routing header (which the no-op
  ignores), so Envoy takes its headers route: headers, then body, two messages each way;
- ``sidecar_pd`` / ``sidecar_deflect``: the decode node's sidecar called straight, with the
  routing headers the dispatcher would set (keep + prefill host; deflect + chunk schedule; both
  with a TTFT prediction, so the sidecar sends its TTFT feedback as behind the dispatcher);
- ``noop_gateway_pd``: the Kairos Envoy config + the no-op ext_proc setting the P/D routing
  headers, in front of that sidecar: the whole P/D path but the dispatcher's own work;
- ``router_pd``: vLLM's Rust router, P/D mode, same prefill and decode nodes;
- ``kairos_pd`` / ``kairos_deflect``: Envoy + dispatcher + sidecar, the whole gateway;
- ``kairos_pd_count``: the same as ``kairos_pd`` with the cache-blind dispatcher (count only).

Added time over ``direct`` is what each router costs, node-side P/D costs in. The breakdown of
Kairos's added time, by differences of p50 (and of p99) between paths of the same run:

    envoy                   envoy - direct
    ext_proc round trips    envoy_noop_extproc - envoy
      (on the headers route: envoy_noop_two_messages - envoy)
    gateway on longer path  (noop_gateway_pd - sidecar_pd) - (envoy_noop_extproc - direct)
    parse, ids, lookup,     kairos_pd - noop_gateway_pd
      decide
    of which ids + lookup   kairos_pd - kairos_pd_count  (the prefix path over the count-only one)
    sidecar hops            sidecar_pd - client_pd   (deflect: sidecar_deflect - direct_deflect)
    nodes' own route cost   client_pd - direct       (deflect: direct_deflect - direct)

(deflect has no no-op in front of its sidecar: its parse, count, decide and the gateway's cost on
the longer path come as one part, (kairos_deflect - sidecar_deflect) - (envoy_noop_extproc - direct))

plus, for reference, the dispatcher's own decision histogram and the in-process time of its parse
+ count. The deflect cluster's dispatcher holds a deflection's reservation for 1 ms
(``KAIROS_DISPATCHER_RESERVATION_TTL_S``; 3 heartbeat periods by default), so that every
request of a sequential client deflects; any that does not is counted off_route, not timed.

    python -m bench.micro.gateway_overhead [--requests 300] [--router PATH] [--json PATH]

``--requests`` is the 2 KB count per path; 100 KB runs half of it (at least 50).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.bodies import completion_body
from bench.harness.loadgen import HttpConnection, build_request, post_once
from bench.harness.results import percentiles_us, write_result
from bench.harness.scrape import histogram_summary, scrape_counters, scrape_histogram
from bench.harness.waiting import wait_until
from kairos.api.openai_request import RequestLimits, parse_request
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.block_hash import block_keys
from kairos.launcher.envoy_config import EnvoySettings
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig, cluster_config
from kairos.launcher.processes import ManagedProcess, ProcessGroup, free_port, tcp_ready
from kairos.launcher.servers import envoy_process, gateway_process

ROOT = Path(__file__).resolve().parents[2]

HOST = "127.0.0.1"
BODY_SIZES = {"2KB": 2 * 1024, "100KB": 100 * 1024}
TIME_SCALE = 1000.0
DEFLECT_EVERYTHING = "sl:l=1000000"  # deflect any prompt up to a million tokens
DEFAULT_ROUTER = ROOT / ".venv-router" / "bin" / "vllm-router"
# The deflect cluster's reservation TTL: one sequential client's requests all deflect.
RESERVATION_TTL_ENV = ("KAIROS_DISPATCHER_RESERVATION_TTL_S", "0.001")
DECISION_METRIC = "kairos_dispatcher_decision_seconds"
# The order paths are listed (and printed) in; router_pd only when its binary is found.
PATHS = (
    "direct",
    "client_pd",
    "envoy",
    "envoy_noop_extproc",
    "envoy_noop_two_messages",
    "direct_deflect",
    "sidecar_pd",
    "sidecar_deflect",
    "noop_gateway_pd",
    "router_pd",
    "kairos_pd",
    "kairos_pd_count",
    "kairos_deflect",
)
# Peer comparison: Kairos's added p50 and p99 on each of its paths <= the router's (P/D mode).
PEER = "router_pd"
KAIROS_PATHS = ("kairos_pd", "kairos_pd_count", "kairos_deflect")
PD_COUNT_ONLY = "pd:prefix=off"
PREFIX_LOOKUP_METRIC = "kairos_dispatcher_prefix_lookup_prompt_tokens_total"
PREFIX_HIT_METRIC = "kairos_dispatcher_prefix_hit_tokens_total"

MINIMAL_ENVOY = """\
admin:
  address: {{socket_address: {{address: {host}, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: plain
    address: {{socket_address: {{address: {host}, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: plain
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {upstream_port}}}}}}}
"""


def with_field(body: bytes, name: str, value: Any) -> bytes:
    """``body`` (a non-empty JSON object without ``name``) with ``"name": value`` added at its end."""
    head = body.rstrip()
    assert head.endswith(b"}") and name.encode() not in body
    return head[:-1] + b"," + json.dumps(name).encode() + b":" + json.dumps(value).encode() + b"}"


# ---------------------------------------------------------------------------------------------
# Statistics and the in-process reference
# ---------------------------------------------------------------------------------------------
def latency_stats(samples_ns: list[int]) -> dict[str, float]:
    got = percentiles_us(samples_ns)
    return {
        "p50_ms": got["p50_us"] / 1e3,
        "p99_ms": got["p99_us"] / 1e3,
        "mean_ms": float(np.mean(samples_ns)) / 1e6,
        "samples": got["samples"],
    }


def _timed(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> list[int]:
    """``reps`` timings (ns) of ``fn`` after 3 warm-up calls; ``setup`` runs untimed before each."""
    for _ in range(3):
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return samples


def tokenize_reference(tokenizer: PromptTokenizer, bodies: dict[str, bytes]) -> dict[str, Any]:
    """In-process time of the dispatcher's parse + count of each body (no gateway around it),
    and its parts: the JSON parse and the exact count (word cache warm, as in the latency runs
    that repeat one body, and cold)."""
    limits = RequestLimits()
    out: dict[str, Any] = {}
    fresh: list[PromptTokenizer] = []

    def new_counter() -> None:  # a tokenizer with an empty word cache
        fresh[:] = [PromptTokenizer(tokenizer.raw_tokenizer)]

    for label, body in bodies.items():
        reps = 300 if len(body) < 16_384 else 40
        parsed = parse_request("/v1/completions", body, tokenizer, limits)
        prompt = json.loads(body)["prompt"]
        ids = parse_request("/v1/completions", body, tokenizer, limits, token_ids=True).prompt_token_ids or []
        stages = {
            "json_loads": _timed(lambda b=body: json.loads(b), reps),
            "count_tokens_warm_cache": _timed(lambda p=prompt: tokenizer.count_tokens(p), reps),
            "count_tokens_cold_cache": _timed(lambda p=prompt: fresh[0].count_tokens(p), reps // 4 or 1, new_counter),
            # What the prefix-aware dispatcher pays instead of the parse + count: the parse to
            # token ids, and their block hashes (the index walk after them: bench/micro/prefix_lookup.py).
            "parse_to_token_ids": _timed(
                lambda b=body: parse_request("/v1/completions", b, tokenizer, limits, token_ids=True), reps
            ),
            "hash_blocks_16": _timed(lambda i=ids: block_keys(i, 16), reps),
        }
        samples = _timed(lambda b=body: parse_request("/v1/completions", b, tokenizer, limits), reps)
        out[label] = {
            "body_bytes": len(body),
            "prompt_tokens": parsed.prompt_tokens,
            **latency_stats(samples),
            "stages": {name: latency_stats(s) for name, s in stages.items()},
        }
    return out


# ---------------------------------------------------------------------------------------------
# The paths: each one coroutine that sends one request and says how long it took
# ---------------------------------------------------------------------------------------------
@dataclass
class PathRunner:
    """How to send one request on a path: ``send`` returns (ns, on the expected route)."""

    name: str
    send: Callable[[], Awaitable[tuple[int, bool]]]
    close: Callable[[], Awaitable[None]]


async def plain_path(
    name: str,
    hostport: tuple[str, int],
    body: bytes,
    headers: tuple[tuple[str, str], ...] = (),
    want_route: str | None = None,
) -> PathRunner:
    conn = await HttpConnection.open(*hostport)
    request = build_request(hostport[0], hostport[1], "/v1/completions", body, headers)

    async def send() -> tuple[int, bool]:
        t0 = time.perf_counter_ns()
        resp = await conn.send(request)
        elapsed = time.perf_counter_ns() - t0
        if resp.status != 200:
            raise RuntimeError(f"{name}: status {resp.status}: {resp.body[:300]!r}")
        return elapsed, want_route is None or resp.headers.get(c.H_ROUTE) == want_route

    return PathRunner(name, send, conn.close)


async def client_pd_path(prefill: tuple[str, int], decode: tuple[str, int], body: bytes) -> PathRunner:
    """The P/D hand-off done by this client, as lean as it can be: the prefill hop's request is
    encoded once; the decode hop's is the body with the reply's kv_transfer_params spliced in."""
    p_conn, d_conn = await HttpConnection.open(*prefill), await HttpConnection.open(*decode)
    hop1 = json.loads(body) | {"stream": False, "max_tokens": 1, c.KV_TRANSFER_PARAMS: {"do_remote_decode": True}}
    hop1_request = build_request(prefill[0], prefill[1], "/v1/completions", json.dumps(hop1).encode())
    d_head = f"POST /v1/completions HTTP/1.1\r\nHost: {decode[0]}:{decode[1]}\r\nContent-Type: application/json\r\n"

    async def send() -> tuple[int, bool]:
        t0 = time.perf_counter_ns()
        first = await p_conn.send(hop1_request)
        if first.status != 200:
            raise RuntimeError(f"client_pd hop 1: status {first.status}: {first.body[:300]!r}")
        data = with_field(body, c.KV_TRANSFER_PARAMS, json.loads(first.body)[c.KV_TRANSFER_PARAMS])
        resp = await d_conn.send(f"{d_head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        elapsed = time.perf_counter_ns() - t0
        if resp.status != 200:
            raise RuntimeError(f"client_pd hop 2: status {resp.status}: {resp.body[:300]!r}")
        return elapsed, True

    async def close() -> None:
        await p_conn.close()
        await d_conn.close()

    return PathRunner("client_pd", send, close)


async def measure(paths: list[PathRunner], n: int, block: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """``n`` requests per path in blocks of ``block``, the paths' order rotating each round."""
    samples: dict[str, list[int]] = {p.name: [] for p in paths}
    off_route = {p.name: 0 for p in paths}
    for p in paths:  # warm-up: connections, pools, caches
        for _ in range(5):
            await p.send()
    for round_no in range(-(-n // block)):
        k = min(block, n - round_no * block)
        first = round_no % len(paths)
        for p in paths[first:] + paths[:first]:
            for _ in range(k):
                elapsed, on_route = await p.send()
                if on_route:
                    samples[p.name].append(elapsed)
                else:
                    off_route[p.name] += 1
    return samples, off_route


def keep_headers(prefill_url: str) -> tuple[tuple[str, str], ...]:
    """What the P/D dispatcher sets on a keep request. The prediction makes the sidecar send its
    TTFT feedback, as behind the real dispatcher: sidecar_pd and noop_gateway_pd both carry it, so
    its cost is in the sidecar hops, not in the gateway on the longer path."""
    return (
        (c.H_ROUTE, "keep"),
        (c.H_REASON, "pd_only"),
        (c.H_DECODE_NODE, "d0"),
        (c.H_PREFILL_HOST, prefill_url),
        (c.H_PRED_TTFT_PREFILL_MS, "10.0"),
    )


async def open_paths(
    targets: dict[str, tuple[str, int]], body: bytes, schedule: str, prefill_url: str
) -> list[PathRunner]:
    keep = keep_headers(prefill_url)
    sizes = c.parse_chunk_schedule_header(schedule)
    deflect_headers = (
        (c.H_ROUTE, "deflect"),
        (c.H_CHUNK_SCHEDULE, schedule),
        (c.H_DECODE_NODE, "d0"),
        (c.H_PRED_TTFT_DECODE_MS, "10.0"),
    )
    makers: dict[str, Callable[[], Awaitable[PathRunner]]] = {
        "direct": lambda: plain_path("direct", targets["direct"], body),
        "client_pd": lambda: client_pd_path(targets["prefill"], targets["direct"], body),
        "envoy": lambda: plain_path("envoy", targets["envoy"], body),
        "envoy_noop_extproc": lambda: plain_path("envoy_noop_extproc", targets["envoy_noop_extproc"], body),
        "envoy_noop_two_messages": lambda: plain_path(
            "envoy_noop_two_messages", targets["envoy_noop_extproc"], body, ((c.H_REASON, "headers-route"),)
        ),
        "direct_deflect": lambda: plain_path(
            "direct_deflect", targets["direct_deflect"], with_field(body, c.VLLM_XARGS, c.schedule_xargs(sizes))
        ),
        "sidecar_pd": lambda: plain_path("sidecar_pd", targets["sidecar_pd"], body, keep),
        "sidecar_deflect": lambda: plain_path("sidecar_deflect", targets["sidecar_deflect"], body, deflect_headers),
        "noop_gateway_pd": lambda: plain_path("noop_gateway_pd", targets["noop_gateway_pd"], body),
        "router_pd": lambda: plain_path("router_pd", targets["router_pd"], body),
        "kairos_pd": lambda: plain_path("kairos_pd", targets["kairos_pd"], body, want_route="keep"),
        "kairos_pd_count": lambda: plain_path("kairos_pd_count", targets["kairos_pd_count"], body, want_route="keep"),
        "kairos_deflect": lambda: plain_path("kairos_deflect", targets["kairos_deflect"], body, want_route="deflect"),
    }
    return [await makers[name]() for name in PATHS if name != PEER or PEER in targets]


async def run_size(
    targets: dict[str, tuple[str, int]], body: bytes, schedule: str, prefill_url: str, n: int, block: int
) -> tuple[dict[str, list[int]], dict[str, int]]:
    paths = await open_paths(targets, body, schedule, prefill_url)
    try:
        return await measure(paths, n, block)
    finally:
        for p in paths:
            await p.close()


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
def find_router(given: str | None) -> str | None:
    if given:
        return given
    if DEFAULT_ROUTER.exists():
        return str(DEFAULT_ROUTER)
    return shutil.which("vllm-router")


def hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def gateway_cluster_config(policy: str) -> LocalClusterConfig:
    return cluster_config(
        prefill_nodes=1,
        decode_nodes=1,
        dispatchers=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        policy=policy,
        log_level="WARNING",
    )


def start_noop_gateway(
    group: ProcessGroup, workdir: Path, name: str, upstream: str, headers: tuple[tuple[str, str], ...] = ()
) -> tuple[str, int]:
    """The Kairos Envoy config in front of the no-op ext_proc, which sends every request to
    ``upstream`` with ``headers`` set (default: only its own x-kairos-route)."""
    grpc_port, port, admin = free_port(), free_port(), free_port()
    group.start(
        ManagedProcess(
            f"{name}-extproc",
            [
                sys.executable,
                "-m",
                "bench.harness.noop_extproc",
                "--host",
                HOST,
                "--port",
                str(grpc_port),
                "--destination",
                upstream,
                *(f"--header={k}={v}" for k, v in headers),
            ],
            workdir / f"{name}-extproc.log",
            ready=tcp_ready(HOST, grpc_port),
            cwd=ROOT,
        ),
        timeout_s=60,
    )
    settings = EnvoySettings(
        listen_host=HOST,
        listen_port=port,
        admin_host=HOST,
        admin_port=admin,
        dispatchers=(f"{HOST}:{grpc_port}",),
        sidecars=(upstream,),
    )
    name = f"{name}-envoy"
    group.start(gateway_process(name, settings, workdir / f"{name}.yaml", workdir / f"{name}.log"), timeout_s=60)
    return HOST, port


def start_envoy(group: ProcessGroup, workdir: Path, name: str, cfg: Path, admin: int) -> None:
    group.start(envoy_process(name, cfg, workdir / f"{name}.log", admin, admin_host=HOST), timeout_s=60)


def start_extras(
    group: ProcessGroup, workdir: Path, prefill_url: str, decode_url: str, sidecar_url: str, router_bin: str | None
) -> dict[str, tuple[str, int]]:
    """Envoy alone and Envoy + the no-op ext_proc in front of the decode node, Envoy + the
    no-op ext_proc setting the P/D path's routing headers in front of its sidecar; the router."""
    _, up_port = hostport(decode_url)
    plain_port, plain_admin = free_port(), free_port()
    plain_cfg = workdir / "envoy-plain.yaml"
    plain_cfg.write_text(
        MINIMAL_ENVOY.format(host=HOST, port=plain_port, admin_port=plain_admin, upstream_port=up_port)
    )
    start_envoy(group, workdir, "envoy-plain", plain_cfg, plain_admin)
    targets = {
        "envoy": (HOST, plain_port),
        "envoy_noop_extproc": start_noop_gateway(group, workdir, "noop", decode_url),
        "noop_gateway_pd": start_noop_gateway(group, workdir, "noop-pd", sidecar_url, keep_headers(prefill_url)),
    }
    if router_bin is not None:
        port = free_port()
        group.start(
            ManagedProcess(
                "vllm-router",
                # Its Prometheus exporter on a free port too: the default (29000) may be another run's.
                [
                    router_bin,
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--vllm-pd-disaggregation",
                    "--prefill",
                    f"http://{prefill_url}",
                    "--decode",
                    f"http://{decode_url}",
                    "--log-level",
                    "warning",
                    "--prometheus-port",
                    str(free_port()),
                ],
                workdir / "router.log",
                ready=tcp_ready(HOST, port),
            ),
            timeout_s=60,
        )
        targets["router_pd"] = (HOST, port)
    return targets


def serves(hp: tuple[str, int], body: bytes) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return asyncio.run(post_once(*hp, "/v1/completions", body)).status == 200
        except (OSError, RuntimeError):
            return False

    return probe


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def breakdown(stats: dict[str, dict[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Kairos's added time in parts, by differences between paths (p50 and p99 alike; the p99
    parts are differences of tails, so they need not add up, and may be negative)."""
    ks = ("p50_ms", "p99_ms")

    def d(a: str, b: str) -> dict[str, float]:
        return {k: stats[a][k] - stats[b][k] for k in ks}

    def minus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: a[k] - b[k] for k in ks}

    noop_floor = d("envoy_noop_extproc", "direct")  # Envoy + a no-op ext_proc in front of one node
    out = {
        "pd": {
            "envoy": d("envoy", "direct"),
            "ext_proc_round_trips": d("envoy_noop_extproc", "envoy"),
            "ext_proc_two_messages": d("envoy_noop_two_messages", "envoy"),
            # The same Envoy + no-op in front of the sidecar's two hops, over that floor: what the
            # longer path behind the gateway costs it on this machine's shared cores.
            "gateway_on_longer_path": minus(d("noop_gateway_pd", "sidecar_pd"), noop_floor),
            "parse_ids_lookup_decide": d("kairos_pd", "noop_gateway_pd"),
            "token_ids_and_lookup": d("kairos_pd", "kairos_pd_count"),
            "sidecar_hops": d("sidecar_pd", "client_pd"),
            "nodes_route_cost": d("client_pd", "direct"),
            "total_added": d("kairos_pd", "direct"),
        },
        "deflect": {
            "envoy": d("envoy", "direct"),
            "ext_proc_round_trips": d("envoy_noop_extproc", "envoy"),
            # No no-op in front of the deflect sidecar (its schedule depends on the body): the
            # dispatcher's work and the gateway's cost on the longer path, together.
            "parse_count_decide_and_rest": minus(d("kairos_deflect", "sidecar_deflect"), noop_floor),
            "sidecar_hops": d("sidecar_deflect", "direct_deflect"),
            "nodes_route_cost": d("direct_deflect", "direct"),
            "total_added": d("kairos_deflect", "direct"),
        },
    }
    if PEER in stats:
        out["router_pd"] = {
            "router_own": d(PEER, "client_pd"),
            "nodes_route_cost": d("client_pd", "direct"),
            "total_added": d(PEER, "direct"),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    router_bin = find_router(args.router)
    bodies = {label: completion_body(size, seed=i + 1) for i, (label, size) in enumerate(BODY_SIZES.items())}
    with (
        tempfile.TemporaryDirectory(prefix="kairos-gwbench-") as tmp,
        ProcessGroup() as extras,
        contextlib.ExitStack() as clusters,
    ):
        workdir = Path(tmp)
        pd = clusters.enter_context(LocalCluster(gateway_cluster_config("pd"), workdir / "pd"))
        pd_count = clusters.enter_context(LocalCluster(gateway_cluster_config(PD_COUNT_ONLY), workdir / "pd-count"))
        name, value = RESERVATION_TTL_ENV
        os.environ[name] = value  # read by the deflect cluster's dispatcher when it starts
        try:
            deflect = clusters.enter_context(
                LocalCluster(gateway_cluster_config(DEFLECT_EVERYTHING), workdir / "deflect")
            )
        finally:
            del os.environ[name]
        for cluster in (pd, pd_count, deflect):
            cluster.wait_for_heartbeats()
        assert pd.model_dir is not None
        tokenize = tokenize_reference(PromptTokenizer.from_dir(pd.model_dir), bodies)
        prefill_url, decode_url = pd.node("p0").url, pd.node("d0").url
        targets = {
            "direct": hostport(decode_url),
            "prefill": hostport(prefill_url),
            "sidecar_pd": hostport(pd.node("d0").sidecar_url),
            "direct_deflect": hostport(deflect.node("d0").url),
            "sidecar_deflect": hostport(deflect.node("d0").sidecar_url),
            "kairos_pd": hostport(pd.gateway_url),
            "kairos_pd_count": hostport(pd_count.gateway_url),
            "kairos_deflect": hostport(deflect.gateway_url),
            **start_extras(extras, workdir, prefill_url, decode_url, pd.node("d0").sidecar_url, router_bin),
        }
        for name in ("envoy", "envoy_noop_extproc", "noop_gateway_pd", PEER):
            if name in targets:
                wait_until(serves(targets[name], bodies["2KB"]), 60, f"{name} to serve a completion")
        metrics_url = f"http://{HOST}:{pd.dispatcher_metrics_ports[0]}/metrics"
        count_metrics_url = f"http://{HOST}:{pd_count.dispatcher_metrics_ports[0]}/metrics"
        load_before = os.getloadavg()
        latency: dict[str, Any] = {}
        for label, body in bodies.items():
            check = asyncio.run(post_once(*targets["kairos_deflect"], "/v1/completions", body))
            if check.status != 200 or check.headers.get(c.H_ROUTE) != "deflect":
                raise RuntimeError(f"kairos_deflect: {check.status} route {check.headers.get(c.H_ROUTE)!r}")
            schedule = check.headers[c.H_CHUNK_SCHEDULE]  # what the dispatcher sets, for sidecar_deflect
            n = args.requests if label == "2KB" else max(50, args.requests // 2)
            started = time.monotonic()
            before = scrape_histogram(metrics_url, DECISION_METRIC)
            count_before = scrape_histogram(count_metrics_url, DECISION_METRIC)
            lookups_before = scrape_counters(metrics_url, (PREFIX_LOOKUP_METRIC, PREFIX_HIT_METRIC))
            samples, off_route = asyncio.run(run_size(targets, body, schedule, prefill_url, n, block=25))
            hist = histogram_summary(before, scrape_histogram(metrics_url, DECISION_METRIC))
            count_hist = histogram_summary(count_before, scrape_histogram(count_metrics_url, DECISION_METRIC))
            lookups = {
                k: v - lookups_before.get(k, 0.0)
                for k, v in scrape_counters(metrics_url, (PREFIX_LOOKUP_METRIC, PREFIX_HIT_METRIC)).items()
            }
            stats = {p: {**latency_stats(s), "off_route": off_route[p]} for p, s in samples.items()}
            added = {
                p: {k: s[k] - stats["direct"][k] for k in ("p50_ms", "p99_ms", "mean_ms")}
                for p, s in stats.items()
                if p != "direct"
            }
            latency[label] = {
                "body_bytes": len(body),
                "prompt_tokens": tokenize[label]["prompt_tokens"],
                "requests_per_path": n,
                "wall_s": time.monotonic() - started,
                "paths": stats,
                "added_over_direct": added,
                "breakdown": breakdown(stats),
                "kairos_pd_dispatcher_decision_seconds": hist,
                "kairos_pd_count_dispatcher_decision_seconds": count_hist,
                # Proof the prefix path ran: prompt tokens looked up and predicted hits, by series.
                "kairos_pd_prefix_lookups": lookups,
                "parse_count_in_process": {k: tokenize[label][k] for k in ("p50_ms", "p99_ms", "mean_ms")},
                "parse_count_stages_in_process": {
                    name: {k: stage[k] for k in ("p50_ms", "p99_ms", "mean_ms")}
                    for name, stage in tokenize[label]["stages"].items()
                },
            }
            print_latency(label, latency[label])
        load_after = os.getloadavg()
    targets_met: dict[str, bool] = {}
    for label, row in latency.items():
        if PEER not in row["added_over_direct"]:
            continue
        peer = row["added_over_direct"][PEER]
        for path in KAIROS_PATHS:
            for k in ("p50_ms", "p99_ms"):
                targets_met[f"{label}_{path}_added_{k}<=router_pd"] = row["added_over_direct"][path][k] <= peer[k]
    for name, met in targets_met.items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    return {
        "config": {
            "time_scale": TIME_SCALE,
            "requests_2KB": args.requests,
            "requests_100KB": max(50, args.requests // 2),
            "router": router_bin or "not found (scripts/router_env.sh builds .venv-router)",
            "cores": os.cpu_count(),
        },
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "latency": latency,
        "targets_met": targets_met,
        "notes": [
            "Sequential non-streaming completions, max_tokens 1, one keep-alive connection per path (two for "
            "client_pd), paths interleaved in blocks of 25 with rotating order, all in one run; added = "
            "difference of percentiles over direct, not percentile of differences; the breakdown parts are "
            "differences of percentiles between paths too, so their p99s need not add up.",
            "The deflect cluster's dispatcher holds a deflection's reservation for 1 ms instead of 3 heartbeat "
            "periods, so that each request of the sequential client deflects; off_route counts those that did "
            "not (not timed). The P/D cluster's dispatcher makes no reservations.",
            "Everything shares this machine's cores with whatever else runs on it: the client, both clusters "
            "(emulated nodes, sidecars, publishers, dispatchers, Envoys, Redis), the extra Envoys, the no-op "
            "ext_proc and the router; compare paths within one run only.",
            "parse_count_in_process: the dispatcher's parse + exact token count of each body timed alone in this "
            "process, for reference; kairos_pd_dispatcher_decision_seconds: the P/D dispatcher's own histogram "
            "(request body to routing answer) over the measured requests, percentiles interpolated in buckets.",
            "kairos_pd runs the prefix path (token ids, vLLM's block hashes, the index walk; one body repeated, "
            "so every block hits and is hashed: its worst case), kairos_pd_count the count-only path; "
            "kairos_pd_prefix_lookups shows the lookups ran. parse_count_stages_in_process parse_to_token_ids "
            "and hash_blocks_16 time the prefix path's first two parts in process.",
            "Every cluster's nodes cache prefixes and publish their KV events; only kairos_pd's dispatcher reads "
            "them (the deflect cluster's sl policy is cache-blind).",
        ],
    }


def print_latency(label: str, row: dict[str, Any]) -> None:
    print(
        f"\n{label} body ({row['body_bytes']} bytes, {row['prompt_tokens']} prompt tokens), "
        f"{row['requests_per_path']} sequential requests per path"
    )
    print(f"  {'path':<24} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}")
    for p, s in row["paths"].items():
        a = row["added_over_direct"].get(p, {"p50_ms": 0.0, "p99_ms": 0.0})
        off = f"  ({s['off_route']} off route)" if s["off_route"] else ""
        print(f"  {p:<24} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {a['p50_ms']:>+10.2f} {a['p99_ms']:>+10.2f}{off}")
    for route, parts in row["breakdown"].items():
        print(f"  breakdown {route} (p50 / p99 ms):")
        for part, v in parts.items():
            print(f"    {part:<22} {v['p50_ms']:+7.2f} / {v['p99_ms']:+7.2f}")
    for path in ("kairos_pd", "kairos_pd_count"):
        h = row[f"{path}_dispatcher_decision_seconds"]
        if h.get("count"):
            print(f"  dispatcher decision histogram ({path}): n={h['count']} mean {h['mean_ms']:.3f} ms")
    print(f"  kairos_pd prefix lookups: {row['kairos_pd_prefix_lookups']}")
    tok = row["parse_count_in_process"]
    print(f"  parse + count in process: p50 {tok['p50_ms']:.3f} ms, p99 {tok['p99_ms']:.3f} ms")
    stages = row["parse_count_stages_in_process"]
    ids, hashes = stages["parse_to_token_ids"], stages["hash_blocks_16"]
    print(
        f"  the prefix path's parts: parse to token ids p50 {ids['p50_ms']:.3f} ms, "
        f"p99 {ids['p99_ms']:.3f}; block hashes p50 {hashes['p50_ms']:.3f} ms, p99 {hashes['p99_ms']:.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential 2 KB requests per path (100 KB: half)")
    parser.add_argument("--router", help="the vllm-router binary (default: .venv-router/bin/vllm-router or PATH)")
    parser.add_argument("--json", type=Path, help="output path (default bench/results/gateway_overhead.json)")
    args = parser.parse_args()
    write_result("gateway_overhead", run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
