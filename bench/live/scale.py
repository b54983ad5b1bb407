"""How far one Redis and one dispatcher pool go: 1,000 nodes' heartbeats every 100 ms, with
K = 1, 2, 4 dispatcher replicas behind one Envoy, on this machine, with real redis-server.

A few publisher processes (``bench/live/scale.py publish``) each beat for a share of the nodes: every
100 ms, one pipeline of ``SET kairos:node:{id} <heartbeat> PX 500`` + ``PUBLISH`` per node, the
heartbeat built by the node agent's own code (``build_heartbeat``, ``encode_heartbeat``), each
node's load a random walk (decode batches and KV, prefill queues), so decisions vary and the
values change every beat. Every node's URL and sidecar is one fast upstream
(``bench/harness/loadgen.py upstream``), so every routed request is answered at once and the dispatchers
and Redis are what is measured. For each K, after every dispatcher's view holds all nodes:

1. an idle window (refresh only): Redis CPU and commands/s, each dispatcher's CPU, its poll
   time (``kairos_dispatcher_view_poll_seconds``) and the view's worst staleness
   (``kairos_dispatcher_view_oldest_heartbeat_seconds``: the oldest heartbeat at each poll,
   just before its update, aged from when this dispatcher first read it), and that age's parts:
   how far apart the publishers wrote each node's beats (and how late their batches began), how
   long after its ``sent_at`` a beat entered the view
   (``kairos_dispatcher_view_read_delay_seconds``, the largest at each poll), how late the polls
   began (``kairos_dispatcher_view_poll_lateness_seconds``), and of a poll's time how much was
   Redis (``kairos_dispatcher_view_read_seconds``) and how much waiting for the dispatcher's
   event loop (``kairos_dispatcher_view_apply_wait_seconds``);
2. a steady window: 2 KB completions through Envoy at a fixed offered rate (``--steady-rps``,
   the same for every K, below what K = 4 serves here): the same figures while the pool serves
   a given load without being saturated, the question an operator sizing replicas asks;
3. a load window: a closed loop of 2 KB completions through Envoy: requests/s, the dispatchers'
   decision time (``kairos_dispatcher_decision_seconds``, bucket-interpolated, body to answer:
   parse, Algorithm 1, the reservation's Redis round trip and every wait on a busy event loop)
   and the policy's own compute (``kairos_dispatcher_policy_seconds``), routes, reservation
   conflicts, and the same refresh figures under load.

Each K runs under two harnesses (``--gateway-nice``). "fair" (10): the publishers, Redis, the
upstream and the load generator (this process) run 10 nice steps above Envoy and the
dispatchers, and the first three also SCHED_RR (:class:`Priorities`: nice alone does not keep
them from waiting on this kernel): they stand for other machines (node agents, a Redis host,
clients), which in production never wait for the gateway's CPUs; on 2 shared cores they
otherwise do, and a late publisher ages every view by itself. The stand-ins are raised (which
needs root) rather than the gateway lowered, so the gateway keeps the priority it has in
"shared" against anything else on the machine; without root the gateway is lowered instead and
nothing runs SCHED_RR. "shared" (0): one priority for all, the earlier harness, kept for its
end-to-end figure.

And once, in process, on the very view a dispatcher builds from those 1,000 heartbeats
(``Membership.poll_succeeded`` on one MGET): Algorithm 1's decision time, exact p50/p99, for 1K,
10K and 32K-token prompts, and a poll's membership cost when every value is new and when none is.
Both the dispatchers and this decision run ``--policy`` (default ``kairos:gate=off``): every
decision searches all decode nodes and every deflection reserves, the worst case of a view this
size, which the default's deflection gate would skip here (the stand-in prefill nodes are idle).

Targets (issue 13): decision p99 <= 2 ms with 1,000 nodes in the view; no heartbeat older than
2 x 100 ms in any dispatcher's view while Redis holds. Everything shares the machine's cores
(the JSON records them and the load average).

    python -m bench.live.scale [--nodes 1000] [--prefill-nodes 100] [--publishers 4]
                               [--dispatchers 1,2,4] [--gateway-nice 10,0] [--idle-s 10] [--load-s 15]
                               [--connections 16] [--steady-rps 100] [--baseline-tree PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis
from bench.harness.bodies import completion_body
from bench.harness.loadgen import LoadResult, build_request, closed_loop, paced
from bench.harness.priorities import FAIR_NICE_GAP, CpuMeter, Priorities, harness_name
from bench.harness.results import percentiles_us, write_result
from bench.harness.scrape import histogram_summary, scrape_decisions, scrape_histogram
from bench.harness.waiting import wait_until
from kairos.common.config import with_settings
from kairos.common.contracts import (
    HEARTBEAT_PERIOD_S,
    REDIS_HEARTBEAT_CHANNEL,
    REDIS_NODE_PATTERN,
    encode_heartbeat,
)
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.core.policies.kairos import gateway_settings
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.extproc.config import DispatcherConfig
from kairos.extproc.membership import Membership, MembershipConfig
from kairos.launcher.envoy_config import EnvoySettings
from kairos.launcher.processes import ManagedProcess, ProcessGroup, free_port, http_ready, tcp_ready
from kairos.launcher.servers import (
    gateway_process,
    redis_answers,
    redis_process,
    throwaway_redis_options,
)
from kairos.launcher.tinymodel import build_tiny_model
from kairos.nodeagent.heartbeat import EngineState, PublisherConfig, build_heartbeat

ROOT = Path(__file__).resolve().parents[2]

HOST = "127.0.0.1"
MODEL = "kairos-tiny-llama"
KV_CAPACITY_TOKENS = 1_300_000
TARGET_DECISION_P99_MS = 2.0
TARGET_OLDEST_HEARTBEAT_S = 2 * HEARTBEAT_PERIOD_S
POLL_METRIC = "kairos_dispatcher_view_poll_seconds"
OLDEST_METRIC = "kairos_dispatcher_view_oldest_heartbeat_seconds"
HEAR_PROMISES_ENV = "KAIROS_DISPATCHER_HEAR_PROMISES"  # set only when off: a baseline tree may not know it
LATENESS_METRIC = "kairos_dispatcher_view_poll_lateness_seconds"
READ_DELAY_METRIC = "kairos_dispatcher_view_read_delay_seconds"
READ_METRIC = "kairos_dispatcher_view_read_seconds"
APPLY_WAIT_METRIC = "kairos_dispatcher_view_apply_wait_seconds"
DECISION_METRIC = "kairos_dispatcher_decision_seconds"
POLICY_METRIC = "kairos_dispatcher_policy_seconds"
# Every decision searches all decode nodes and every deflection reserves: the worst case a view of
# this size costs, which the default's deflection gate skips while the keep path meets the SLO
# with room (here always: the stand-in prefill nodes report no queue).
FULL_SEARCH_POLICY = "kairos:gate=off"
CONFLICTS_METRIC = "kairos_dispatcher_reservation_conflicts_total"


def node_id(index: int, prefill_nodes: int) -> str:
    return f"p{index:04d}" if index < prefill_nodes else f"d{index:04d}"


# ---------------------------------------------------------------------------------------------
# Publisher process: heartbeats for a share of the nodes
# ---------------------------------------------------------------------------------------------
class NodeLoad:
    """One node's load, a random walk: decode batch and KV for a decode node, the queued prompts
    for a prefill node (so prefill waits, and with them keep-or-deflect, vary across nodes)."""

    def __init__(self, prefill: bool, rng: random.Random) -> None:
        self.prefill = prefill
        self.rng = rng
        self.batch = rng.randint(1, 48)
        self.queue = [rng.randint(512, 8192) for _ in range(rng.randint(0, 6))]

    def step(self) -> EngineState:
        rng = self.rng
        if self.prefill:
            if self.queue and rng.random() < 0.3:
                self.queue.pop(0)
            if len(self.queue) < 8 and rng.random() < 0.3:
                self.queue.append(rng.randint(512, 8192))
            return EngineState(0, 0, KV_CAPACITY_TOKENS, tuple(self.queue), (), 2048, MODEL)
        self.batch = min(64, max(0, self.batch + rng.choice((-1, 0, 1))))
        kv = self.batch * 2400 + rng.randint(0, 999)
        return EngineState(self.batch, kv, KV_CAPACITY_TOKENS, (), (), 2048, MODEL)


def publish(args: argparse.Namespace) -> int:
    """Beat for nodes ``first`` .. ``first + count - 1`` every ``period_s`` until SIGTERM, then
    write this publisher's own timing to ``--stats`` (a late batch: one that ended after the
    next period had begun). Every batch also appends ``slot start done`` (CLOCK_MONOTONIC, the
    same in every process) to ``--batches``, so the parent can tell how late, and how far apart,
    the beats of each measurement window were written."""
    client = redis.Redis.from_url(args.redis)
    rng = random.Random(args.seed)
    nodes = []
    for i in range(args.first, args.first + args.count):
        prefill = i < args.prefill_nodes
        cfg = PublisherConfig(
            node_id=node_id(i, args.prefill_nodes),
            role="prefill" if prefill else "decode",
            url=args.upstream,
            redis_url=args.redis,
            **({} if prefill else {"sidecar": args.upstream}),
        )
        nodes.append((cfg, NodeLoad(prefill, random.Random(rng.random()))))
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    seq, late, batch_s = 0, 0, []
    next_at = time.monotonic()
    log = open(args.batches, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    while not stop:
        seq += 1
        t0 = time.monotonic()
        states = [load.step() for _, load in nodes]
        # One node agent reads its engine and sends at once: every beat of the batch is stamped
        # when the batch is sent, so the simulation's own batching is not counted as the
        # dispatchers' read delay.
        sent_at = time.time()
        pipe = client.pipeline(transaction=False)
        for (cfg, _), state in zip(nodes, states, strict=True):
            payload = encode_heartbeat(build_heartbeat(cfg, state, seq, sent_at))
            pipe.set(cfg.key, payload, px=cfg.ttl_ms)
            pipe.publish(REDIS_HEARTBEAT_CHANNEL, payload)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            print(f"beat {seq} failed: {exc}", file=sys.stderr)
        done = time.monotonic()
        log.write(f"{next_at:.6f} {t0:.6f} {done:.6f}\n")
        batch_s.append(done - t0)
        next_at += args.period_s
        if done > next_at:
            late += 1
            next_at = done  # skip the missed slots rather than bursting to catch up
        time.sleep(max(0.0, next_at - time.monotonic()))
    log.close()
    stats = {"nodes": len(nodes), "batches": seq, "late_batches": late, "batch_ms": percentiles_ms(batch_s)}
    Path(args.stats).write_text(json.dumps(stats))
    return 0


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    got = percentiles_us([int(s * 1e9) for s in seconds])
    return {"p50_ms": got["p50_us"] / 1e3, "p99_ms": got["p99_us"] / 1e3, "max_ms": got["max_us"] / 1e3}


# ---------------------------------------------------------------------------------------------
# In-process: Algorithm 1 and the membership rules on the dispatcher's 1,000-node view
# ---------------------------------------------------------------------------------------------
def read_heartbeats(redis_url: str) -> tuple[list[str], list[bytes | None]]:
    """Every node's heartbeat key and value, as one dispatcher poll reads them."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = sorted(k.decode() for k in client.scan_iter(match=REDIS_NODE_PATTERN, count=1000))
        return keys, client.mget(keys)
    finally:
        client.close()


def in_process(keys: list[str], values: list[bytes | None], calls: int, policy_spec: str) -> dict[str, Any]:
    prefix = REDIS_NODE_PATTERN.rstrip("*")
    beats = [(k[len(prefix) :], v) for k, v in zip(keys, values, strict=True) if v is not None]
    membership = Membership(MembershipConfig())
    t0 = time.perf_counter_ns()
    membership.poll_succeeded(beats, 0.0)
    all_new_ns = time.perf_counter_ns() - t0
    same = []
    for i in range(20):
        t0 = time.perf_counter_ns()
        membership.poll_succeeded(beats, 0.001 * (i + 1))  # the same values: nothing to parse
        same.append(time.perf_counter_ns() - t0)
    view = membership.tracker.view()
    policy = create_policy(policy_spec, load_profile())
    decisions: dict[str, Any] = {}
    for prompt in (1024, 10_240, 32_768):
        policy.decide(prompt, view, 0.0)  # warm-up
        samples, routes = [], {}
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            decision = policy.decide(prompt, view, 0.0)
            samples.append(time.perf_counter_ns() - t0)
            routes[str(decision.reason)] = routes.get(str(decision.reason), 0) + 1
        got = percentiles_us(samples)
        decisions[str(prompt)] = {
            "p50_ms": got["p50_us"] / 1e3,
            "p99_ms": got["p99_us"] / 1e3,
            "max_ms": got["max_us"] / 1e3,
            "calls": calls,
            "reasons": routes,
        }
    return {
        "policy": policy.label,
        "prefill_nodes": len(view.prefill),
        "decode_nodes": len(view.decode),
        "membership_poll_ms": {
            "all_values_new": all_new_ns / 1e6,
            "no_value_new_p50": percentiles_us(same)["p50_us"] / 1e3,
        },
        "decision": decisions,
    }


# ---------------------------------------------------------------------------------------------
# Measurements of the running processes
# ---------------------------------------------------------------------------------------------
def redis_commands(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def nodes_in_view(metrics_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/nodes", timeout=5) as resp:
            report = json.loads(resp.read())
    except OSError:
        return -1
    return len(report["nodes"])


def scrape_counter(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def read_batches(path: Path) -> list[tuple[float, float, float]]:
    """A publisher's batches so far: (slot, start, done), CLOCK_MONOTONIC seconds."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:  # the last line may be half written
            rows.append((float(parts[0]), float(parts[1]), float(parts[2])))
    return rows


def writes_in_window(logs: list[Path], begin: float, end: float) -> dict[str, Any]:
    """How the publishers wrote during [begin, end]: a batch's lateness (its start after its
    slot) and each node's write gap (one batch's end to the next's: 100 ms when on time)."""
    lateness, gaps = [], []
    for path in logs:
        batches = read_batches(path)
        for (_, _, prev_done), (slot, start, done) in itertools.pairwise(batches):
            if begin <= done <= end:
                lateness.append(max(0.0, start - slot))
                gaps.append(done - prev_done)
    return {
        "batches": len(gaps),
        "lateness_ms": percentiles_ms(lateness),
        "write_gap_ms": percentiles_ms(gaps),
    }


class Window:
    """CPU, Redis commands, the publishers' writes and the dispatchers' metrics between
    :meth:`begin` and :meth:`end`."""

    def __init__(self, meter: CpuMeter, client: redis.Redis, metrics_urls: list[str], batch_logs: list[Path]) -> None:
        self.meter, self.client, self.urls, self.batch_logs = meter, client, metrics_urls, batch_logs

    def _scrape(self) -> dict[str, Any]:
        return {
            "cpu": self.meter.snapshot(),
            "commands": redis_commands(self.client),
            "at": time.monotonic(),
            "per_dispatcher": [
                {
                    "poll": scrape_histogram(url, POLL_METRIC),
                    "oldest": scrape_histogram(url, OLDEST_METRIC),
                    "lateness": scrape_histogram(url, LATENESS_METRIC),
                    "read_delay": scrape_histogram(url, READ_DELAY_METRIC),
                    "read": scrape_histogram(url, READ_METRIC),
                    "apply_wait": scrape_histogram(url, APPLY_WAIT_METRIC),
                    "decision": scrape_histogram(url, DECISION_METRIC),
                    "policy": scrape_histogram(url, POLICY_METRIC),
                    "decisions": scrape_decisions(url),
                    "conflicts": scrape_counter(url, CONFLICTS_METRIC),
                }
                for url in self.urls
            ],
        }

    def begin(self) -> None:
        self.before = self._scrape()

    def end(self) -> dict[str, Any]:
        after = self._scrape()
        wall = after["at"] - self.before["at"]
        cores = CpuMeter.cores_used(self.before["cpu"], after["cpu"], wall)
        dispatchers = []
        for i, (b, a) in enumerate(zip(self.before["per_dispatcher"], after["per_dispatcher"], strict=True)):
            oldest_max = max_bucket(b["oldest"], a["oldest"])
            dispatchers.append(
                {
                    "cores": cores.get(f"dispatcher-{i}"),
                    "poll": histogram_summary(b["poll"], a["poll"]),
                    "polls_per_s": (a["poll"].get("count", 0) - b["poll"].get("count", 0)) / wall,
                    "poll_lateness": histogram_summary(b["lateness"], a["lateness"]),
                    "poll_lateness_max_bucket_s": max_bucket(b["lateness"], a["lateness"]),
                    "oldest_heartbeat": histogram_summary(b["oldest"], a["oldest"]),
                    "oldest_heartbeat_max_bucket_s": oldest_max,
                    "read_delay": histogram_summary(b["read_delay"], a["read_delay"]),
                    "read_delay_max_bucket_s": max_bucket(b["read_delay"], a["read_delay"]),
                    "redis_read": histogram_summary(b["read"], a["read"]),
                    "apply_wait": histogram_summary(b["apply_wait"], a["apply_wait"]),
                    "decision": histogram_summary(b["decision"], a["decision"]),
                    "policy": histogram_summary(b["policy"], a["policy"]),
                    "decisions": {k: a["decisions"][k] - b["decisions"].get(k, 0) for k in a["decisions"]},
                    "reservation_conflicts": a["conflicts"] - b["conflicts"],
                }
            )
        return {
            "wall_s": wall,
            "cores": cores,
            "redis_commands_per_s": (after["commands"] - self.before["commands"]) / wall,
            "publishers": writes_in_window(self.batch_logs, self.before["at"], after["at"]),
            "dispatchers": dispatchers,
        }


def max_bucket(before: dict[str, float], after: dict[str, float]) -> str:
    """The bound of the lowest bucket that holds every observation of the window: the largest
    observation is at most this ("-" if none, "+Inf" above the last bound)."""
    total = after.get("count", 0.0) - before.get("count", 0.0)
    if total <= 0:
        return "-"
    bounds = sorted((float(k[3:]), after[k] - before.get(k, 0.0)) for k in after if k.startswith("le="))
    for bound, cumulative in bounds:
        if cumulative >= total:
            return "+Inf" if bound == float("inf") else f"{bound:g}"
    return "+Inf"


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
def start_dispatchers(
    group: ProcessGroup,
    k: int,
    logs: Path,
    redis_url: str,
    model_dir: Path,
    upstream: str,
    nice: int,
    policy: str,
    baseline: Path | None = None,
    hear_promises: bool = True,
) -> tuple[int, list[int], dict[str, int]]:
    """K dispatchers and one Envoy in front of them, ``nice`` steps below this process's CPU
    priority (:class:`Priorities`); (Envoy port, metrics ports, pids). With ``baseline`` (another
    checkout with its own ``.venv``), the even-numbered replicas run that tree's dispatcher: a
    change and the tree before it, side by side in the same minutes."""
    py = sys.executable
    below = ["nice", "-n", str(nice)] if nice else []  # nice execs its command: the pid is the process's
    grpc_ports, metrics_ports, pids = [], [], {}
    for i in range(k):
        grpc_port, metrics_port = free_port(), free_port()
        tree, tree_py = ROOT, py
        if baseline is not None and i % 2 == 0:
            tree, tree_py = baseline, str(baseline / ".venv" / "bin" / "python")
        gateway_policy, decider = gateway_settings(policy)  # the spec's decider knobs are the dispatcher's settings
        dispatcher = with_settings(
            DispatcherConfig(),
            host=HOST,
            port=grpc_port,
            metrics_port=metrics_port,
            model_dir=str(model_dir),
            policy=gateway_policy,
            redis_url=redis_url,
            dispatcher_id=f"scale-{i}",
            **decider,
        )
        config_file = DISPATCHER.write(logs / f"k{k}-dispatcher-{i}.yaml", dispatcher)
        # The command's interpreter is the tree's (this one's, or the baseline checkout's).
        proc = group.start(
            ManagedProcess(
                f"dispatcher-{i}",
                [*below, tree_py, *DISPATCHER.command(config_file, "WARNING")[1:]],
                logs / f"k{k}-dispatcher-{i}.log",
                ready=http_ready(f"http://{HOST}:{metrics_port}/health"),
                env={"PYTHONPATH": str(tree), **({} if hear_promises else {HEAR_PROMISES_ENV: "false"})},
                cwd=tree,
            ),
            timeout_s=120,
        )
        grpc_ports.append(grpc_port)
        metrics_ports.append(metrics_port)
        pids[f"dispatcher-{i}"] = proc.pid
    port, admin = free_port(), free_port()
    settings = EnvoySettings(
        listen_host=HOST,
        listen_port=port,
        admin_host=HOST,
        admin_port=admin,
        dispatchers=tuple(f"{HOST}:{p}" for p in grpc_ports),
        sidecars=(upstream,),
    )
    gateway = gateway_process("envoy", settings, logs / f"k{k}-envoy.yaml", logs / f"k{k}-envoy.log", prefix=below)
    envoy = group.start(gateway, timeout_s=60)
    pids["envoy"] = envoy.pid
    return port, metrics_ports, pids


def measure_k(
    k: int, nice: int, args: argparse.Namespace, base: dict[str, Any], base_pids: dict[str, int], body: bytes
) -> dict[str, Any]:
    priorities: Priorities = base["priorities"]
    stand_ins_priority = priorities.open_gap(nice)
    with ProcessGroup() as group:
        port, metrics_ports, pids = start_dispatchers(
            group,
            k,
            base["logs"],
            base["redis_url"],
            base["model_dir"],
            base["upstream"],
            nice,
            args.policy,
            args.baseline_tree,
            args.hear_promises == "on",
        )
        gateway_nice = os.getpriority(os.PRIO_PROCESS, pids["dispatcher-0"])
        for mp in metrics_ports:
            wait_until(lambda mp=mp: nodes_in_view(mp) == args.nodes, 120, f"a dispatcher's view of {args.nodes} nodes")
        meter = CpuMeter({**base_pids, **pids, "client": os.getpid()})
        client = redis.Redis.from_url(base["redis_url"])
        window = Window(meter, client, [f"http://{HOST}:{mp}/metrics" for mp in metrics_ports], base["batch_logs"])
        try:
            request = build_request(HOST, port, "/v1/completions", body)
            asyncio.run(closed_loop(HOST, port, request, args.connections, 2.0))  # warm-up
            window.begin()
            time.sleep(args.idle_s)  # the measurement window: refresh only
            idle = window.end()
            window.begin()
            steady = asyncio.run(paced(HOST, port, request, args.steady_rps, args.load_s, args.connections))
            steadied = window.end()
            window.begin()
            load = asyncio.run(closed_loop(HOST, port, request, args.connections, args.load_s))
            loaded = window.end()
        finally:
            client.close()
            priorities.close_gap()
        return {
            "dispatchers": k,
            "harness": harness_name(nice),
            "priority": {"stand_ins": stand_ins_priority, "gateway": f"nice {gateway_nice}"},
            "idle": idle,
            "steady": {
                **steadied,
                **served(steady),
                "offered_req_per_s": args.steady_rps,
                "late_sends": steady.late_sends,
            },
            "load": {**loaded, **served(load)},
        }


def served(result: LoadResult) -> dict[str, Any]:
    return {
        "completed": result.completed,
        "errors": result.errors,
        "req_per_s": result.req_per_s,
        "latency_ms": percentiles_ms([ns / 1e9 for ns in result.latencies_ns]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="kairos-scale-") as tmp, ProcessGroup() as group:
        workdir = Path(tmp)
        logs = workdir / "logs"
        model_dir = build_tiny_model(workdir / "model")
        up_port, redis_port = free_port(), free_port()
        upstream, redis_url = f"{HOST}:{up_port}", f"redis://{HOST}:{redis_port}/0"
        upstream_proc = group.start(
            ManagedProcess(
                "upstream",
                [py, "-m", "bench.harness.loadgen", "upstream", "--host", HOST, "--port", str(up_port)],
                logs / "upstream.log",
                ready=tcp_ready(HOST, up_port),
                cwd=ROOT,
            )
        )
        redis_options = throwaway_redis_options(HOST, redis_port, workdir)
        redis_ready = redis_answers(HOST, redis_port)
        redis_proc = group.start(redis_process(redis_options, logs / "redis.log", ready=redis_ready))
        base_pids = {"redis": redis_proc.pid}
        share = -(-args.nodes // args.publishers)
        stats_paths, batch_logs = [], []
        for j in range(args.publishers):
            first, count = j * share, min(share, args.nodes - j * share)
            stats_paths.append(workdir / f"publisher-{j}.json")
            batch_logs.append(workdir / f"publisher-{j}.batches")
            proc = group.start(
                ManagedProcess(
                    f"publisher-{j}",
                    [
                        py,
                        "-m",
                        "bench.live.scale",
                        "publish",
                        "--redis",
                        redis_url,
                        "--upstream",
                        upstream,
                        "--first",
                        str(first),
                        "--count",
                        str(count),
                        "--prefill-nodes",
                        str(args.prefill_nodes),
                        "--period-s",
                        str(HEARTBEAT_PERIOD_S),
                        "--seed",
                        str(j),
                        "--stats",
                        str(stats_paths[-1]),
                        "--batches",
                        str(batch_logs[-1]),
                    ],
                    logs / f"publisher-{j}.log",
                    env={"PYTHONPATH": str(ROOT)},
                    cwd=ROOT,
                )
            )
            base_pids[f"publisher-{j}"] = proc.pid
        counter = redis.Redis.from_url(redis_url)
        wait_until(lambda: counter.dbsize() >= args.nodes, 60, f"{args.nodes} heartbeat keys")
        counter.close()
        print(f"{args.nodes} nodes ({args.prefill_nodes} prefill) beating from {args.publishers} publishers")
        load_before = os.getloadavg()
        base = {
            "logs": logs,
            "redis_url": redis_url,
            "model_dir": model_dir,
            "upstream": upstream,
            "batch_logs": batch_logs,
            "priorities": Priorities([*base_pids.values(), upstream_proc.pid], "publishers, Redis, upstream"),
        }
        body = completion_body(2048, seed=1)
        rows = []
        for k in args.dispatchers:
            for nice in args.gateway_nice:
                row = measure_k(k, nice, args, base, base_pids, body)
                print_row(row)
                rows.append(row)
        keys, values = read_heartbeats(redis_url)
        for proc in group.procs:  # they stand for remote nodes: not on the dispatcher's cores
            if proc.name.startswith("publisher-"):
                proc.stop()
        decision = in_process(keys, values, args.calls, args.policy)
        print_in_process(decision)
        publishers = [json.loads(p.read_text()) for p in stats_paths if p.exists()]
        return {
            "config": {
                "nodes": args.nodes,
                "prefill_nodes": args.prefill_nodes,
                "publishers": args.publishers,
                "heartbeat_period_s": HEARTBEAT_PERIOD_S,
                "idle_s": args.idle_s,
                "load_s": args.load_s,
                "connections": args.connections,
                "steady_rps": args.steady_rps,
                "gateway_nice": args.gateway_nice,
                "policy": args.policy,
                "hear_promises": args.hear_promises,
                "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
                "cores": os.cpu_count(),
            },
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
            "targets": {
                "decision_p99_ms": TARGET_DECISION_P99_MS,
                "oldest_heartbeat_s": TARGET_OLDEST_HEARTBEAT_S,
            },
            "replicas": rows,
            "in_process": decision,
            "publishers": publishers,
        }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _quantile(summary: dict[str, Any], q: str, spec: str = ".1f") -> str:
    """A bucket-interpolated quantile in ms, or the open bucket it fell in ("> 100")."""
    if not summary.get("count"):
        return "-"
    value = summary.get(f"{q}_ms_from_buckets")
    return format(value, spec) if value is not None else summary[f"{q}_bucket"].removesuffix(" ms")


def print_row(row: dict[str, Any]) -> None:
    k = row["dispatchers"]
    for phase in ("idle", "steady", "load"):
        w = row[phase]
        cores = w["cores"]
        d = w["dispatchers"]
        pub = w["publishers"]
        gap = pub["write_gap_ms"]

        def each(fn: Any, d: list[dict[str, Any]] = d) -> str:
            return ", ".join(fn(x) for x in d)

        extra = ""
        if phase != "idle":
            routes: dict[str, float] = {}
            for x in d:
                for label, n in x["decisions"].items():
                    route = label.split('route="', 1)[1].split('"', 1)[0] if 'route="' in label else label
                    routes[route] = routes.get(route, 0) + n
            conflicts = sum(x["reservation_conflicts"] for x in d)
            extra = (
                f"\n    {w['req_per_s']:.0f} req/s{offered(w)}, {w['errors']} errors;"
                f" decision p50 {each(lambda x: _quantile(x['decision'], 'p50'))},"
                f" p99 {each(lambda x: _quantile(x['decision'], 'p99'))} ms;"
                f" policy compute p50 {each(lambda x: _quantile(x['policy'], 'p50', '.2f'))},"
                f" p99 {each(lambda x: _quantile(x['policy'], 'p99', '.2f'))} ms;"
                f" routes {routes}, reservation conflicts {conflicts:.0f}"
            )
        print(
            f"K={k} {row['harness']} {phase}: redis {cores['redis']:.2f} cores, {w['redis_commands_per_s']:.0f} cmd/s;"
            f" machine {cores['machine_busy']:.2f} cores busy; dispatchers {each(lambda x: _fmt(x['cores']))} cores"
            f"\n    oldest heartbeat <= {each(lambda x: x['oldest_heartbeat_max_bucket_s'])} s ="
            f" written {_fmt(gap.get('p99_ms'), '.0f')} p99 / {_fmt(gap.get('max_ms'), '.0f')} max ms apart"
            f" (batch start late <= {_fmt(pub['lateness_ms'].get('max_ms'), '.0f')} ms)"
            f" + read into the view <= {each(lambda x: x['read_delay_max_bucket_s'])} s after;"
            f" polls {each(lambda x: format(x['polls_per_s'], '.1f'))}/s,"
            f" late p99 {each(lambda x: _quantile(x['poll_lateness'], 'p99'))} ms,"
            f" take p99 {each(lambda x: _quantile(x['poll'], 'p99'))} ms"
            f" (Redis read {each(lambda x: _quantile(x['redis_read'], 'p99'))},"
            f" waiting for the loop {each(lambda x: _quantile(x['apply_wait'], 'p99'))}){extra}"
        )


def offered(window: dict[str, Any]) -> str:
    if "offered_req_per_s" not in window:
        return ""  # the closed loop: as fast as answers come
    return f" of {window['offered_req_per_s']:g} offered ({window['late_sends']} sent late)"


def print_in_process(got: dict[str, Any]) -> None:
    mp = got["membership_poll_ms"]
    print(
        f"in process ({got['policy']}), {got['prefill_nodes']}P + {got['decode_nodes']}D view: membership poll"
        f" {mp['all_values_new']:.2f} ms (all values new), {mp['no_value_new_p50']:.2f} ms (none new)"
    )
    for prompt, d in got["decision"].items():
        print(f"  decide, {prompt} tokens: p50 {d['p50_ms']:.3f} ms, p99 {d['p99_ms']:.3f} ms, {d['reasons']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    pub = sub.add_parser("publish", help="(internal) beat for a share of the nodes until SIGTERM")
    pub.add_argument("--redis", required=True)
    pub.add_argument("--upstream", required=True)
    pub.add_argument("--first", type=int, required=True)
    pub.add_argument("--count", type=int, required=True)
    pub.add_argument("--prefill-nodes", type=int, required=True)
    pub.add_argument("--period-s", type=float, default=HEARTBEAT_PERIOD_S)
    pub.add_argument("--seed", type=int, default=0)
    pub.add_argument("--stats", required=True)
    pub.add_argument("--batches", required=True)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--prefill-nodes", type=int, default=100)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--dispatchers", default="1,2,4", help="replica counts, e.g. 1,2,4")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--load-s", type=float, default=15.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--steady-rps",
        type=float,
        default=100.0,
        help="the steady window's offered load, the same for every K (below what K = 4 serves on 2 cores)",
    )
    parser.add_argument(
        "--gateway-nice",
        default=f"{FAIR_NICE_GAP},0",
        help="measure each K with the publishers, Redis, the upstream and the load generator this many nice "
        "steps above Envoy and the dispatchers (10: 'fair', they stand for other machines; 0: 'shared', one "
        "priority for all, the earlier harness)",
    )
    parser.add_argument(
        "--hear-promises",
        choices=("on", "off"),
        default="on",
        help="the dispatchers hear each other's promises as they are made (on, the default) or learn of "
        "them only from refused promises (off, as before 2026-12-06)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of the tree before a change, with its own .venv: the even-numbered replicas run its "
        "dispatcher (e.g. --dispatchers 2: replica 0 before, replica 1 after)",
    )
    parser.add_argument("--calls", type=int, default=2000, help="in-process decisions per prompt size")
    parser.add_argument(
        "--policy",
        default=FULL_SEARCH_POLICY,
        help=f"the dispatchers' policy and the in-process one (default {FULL_SEARCH_POLICY}: the default's "
        "deflection gate would keep every request of this view unsearched, as its prefill nodes are idle)",
    )
    parser.add_argument("--json", type=Path, help="output path (default bench/results/scale.json)")
    args = parser.parse_args(argv)
    if args.command == "publish":
        return publish(args)
    args.dispatchers = [int(x) for x in args.dispatchers.split(",")]
    args.gateway_nice = [int(x) for x in args.gateway_nice.split(",")]
    result = run(args)
    write_result("scale", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
