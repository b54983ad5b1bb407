"""A whole Kairos cluster on one machine: redis-server, N prefill + M decode emulated vLLM
nodes with their heartbeat publishers, a sidecar per decode node, the dispatcher (one or more
replicas) and Envoy. Used by the end-to-end tests and by ``kairos up``.

Every part is a real separate process talking over loopback, so the cluster behaves like a
deployment: killing a node, Redis or the dispatcher is a real fault. Redis requires a credential
(:mod:`kairos.launcher.redis_setup`): each node's agents, the dispatchers and the cluster itself
(:attr:`LocalCluster.redis_url`) have their own ACL user, given to each child in its environment.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kairos.common import defaults
from kairos.common.contracts import HEARTBEAT_PERIOD_S, SIDECAR_METRICS_PATH, Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventsConfig
from kairos.common.runtime import LOG_LEVELS
from kairos.core.policies import validate_gateway_policy
from kairos.launcher.envoy_config import EnvoySettings
from kairos.launcher.processes import (
    ManagedProcess,
    ProcessError,
    ProcessGroup,
    ensure_port_free,
    free_port,
    http_ready,
    tcp_ready,
)
from kairos.launcher.redis_setup import DISPATCHER_ENV, RedisSetup
from kairos.launcher.servers import gateway_process, redis_process

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LocalClusterConfig:
    """Topology and knobs of a local cluster; port 0 means "pick a free one"."""

    prefill_nodes: int = 2
    decode_nodes: int = 2
    dispatchers: int = 1
    gateway_port: int = 8000
    model_dir: str = ""  # tokenizer of the served model (built by kairos.launcher.tinymodel when empty)
    model_name: str = "kairos-tiny-llama"
    profile: str = defaults.PROFILE  # packaged name, or a JSON path the dispatchers watch
    profile_reload_s: float = 1.0  # how often the dispatchers check a profile file (0 = SIGHUP only)
    time_scale: float = 1.0  # emulated nodes run this many times faster than real time
    policy: str = "kairos"  # the dispatchers' policy spec (any but oracle)
    alpha: float = defaults.ALPHA
    beta: float = defaults.BETA
    tbt_slo_ms: float = defaults.TBT_SLO_S * 1e3  # the flag's unit
    ttft_slo_s: float = defaults.TTFT_SLO_S
    max_model_len: int = defaults.MAX_MODEL_LEN
    kv_capacity_tokens: int = defaults.KV_CAPACITY_TOKENS
    prefill_step_tokens: int = defaults.PREFILL_STEP_TOKENS
    decode_step_tokens: int = defaults.DECODE_STEP_TOKENS
    heartbeat_ms: float = HEARTBEAT_PERIOD_S * 1e3  # the flag's unit
    redis_port: int = 0
    # Loopback unless nodes on other machines must reach Redis (their publishers) and clients
    # must reach Envoy: then 0.0.0.0 or this machine's address.
    redis_host: str = LOOPBACK
    redis_tls: bool = False  # TLS only (rediss://), with a CA made for this cluster
    gateway_host: str = LOOPBACK
    log_level: str = "INFO"  # every process's: dispatchers, engines, sidecars, publishers
    # Every node publishes its KV cache events (vLLM's --kv-events-config, on two free ports)
    # and its heartbeat advertises them, so the dispatchers see each node's prefix cache.
    kv_events: bool = True

    def __post_init__(self) -> None:
        level = self.log_level.upper()
        if level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)  # the components' flags take upper case only
        if self.prefill_nodes < 1 or self.decode_nodes < 1 or self.dispatchers < 1:
            raise ConfigError(
                f"need >= 1 of each: prefill_nodes={self.prefill_nodes}, decode_nodes={self.decode_nodes}, "
                f"dispatchers={self.dispatchers}"
            )
        if self.time_scale <= 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale}")
        validate_gateway_policy(self.policy)  # before any process starts
        if self.profile_reload_s < 0:
            raise ConfigError(f"profile_reload_s must be >= 0 (0 = off), got {self.profile_reload_s}")


def kv_events_config(pub_port: int, replay_port: int) -> KvEventsConfig:
    """A node's --kv-events-config: vLLM's ZMQ publisher bound on every interface at these ports
    (vLLM binds only a wildcard endpoint; its heartbeat advertises the node's host instead)."""
    return KvEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic=KV_EVENTS_TOPIC,
    )


@dataclass
class NodeProcs:
    node_id: str
    role: Role
    vllm_port: int
    sidecar_port: int | None
    host: str = LOOPBACK  # where the node's vLLM and sidecar listen (another machine for --nodes)
    # Its engine's --kv-events-config, the same to its heartbeat publisher (None: no events).
    kv_events: KvEventsConfig | None = None
    engine: ManagedProcess | None = None
    publisher: ManagedProcess | None = None
    sidecar: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"{self.host}:{self.vllm_port}"

    @property
    def sidecar_url(self) -> str:
        return f"{self.host}:{self.sidecar_port}" if self.sidecar_port else ""


@dataclass
class LocalCluster:
    config: LocalClusterConfig
    workdir: Path
    group: ProcessGroup = field(default_factory=ProcessGroup)
    nodes: list[NodeProcs] = field(default_factory=list)
    redis: ManagedProcess | None = None
    redis_port: int = 0
    redis_setup: RedisSetup | None = None  # users and passwords, made by start_redis
    dispatcher_procs: list[ManagedProcess] = field(default_factory=list)
    dispatcher_ports: list[int] = field(default_factory=list)
    dispatcher_metrics_ports: list[int] = field(default_factory=list)
    envoy: ManagedProcess | None = None
    envoy_admin_port: int = 0  # Envoy's admin API (/clusters shows what its health checks see)
    gateway_port: int = 0
    model_dir: Path | None = None

    @property
    def gateway_url(self) -> str:
        host = self.config.gateway_host
        return f"http://{LOOPBACK if host in (LOOPBACK, '0.0.0.0') else host}:{self.gateway_port}"

    @property
    def redis_url(self) -> str:
        """The admin user's URL (tests, tools): every right on every key."""
        return self._redis_setup().admin_url

    def _redis_setup(self) -> RedisSetup:
        if self.redis_setup is None:
            raise ProcessError("Redis is not set up yet: start_redis() makes its users")
        return self.redis_setup

    def node(self, node_id: str) -> NodeProcs:
        return next(n for n in self.nodes if n.node_id == node_id)

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        if self.group.procs:  # `with LocalCluster(...).start()` would start a second cluster
            raise ProcessError("this cluster is already started (the with statement starts it)")
        cfg = self.config
        self.workdir.mkdir(parents=True, exist_ok=True)
        if cfg.gateway_port:
            ensure_port_free(cfg.gateway_host, cfg.gateway_port, "the gateway")
        if cfg.redis_port:
            ensure_port_free(cfg.redis_host, cfg.redis_port, "Redis")
        try:
            self.model_dir = Path(cfg.model_dir) if cfg.model_dir else self._build_model()
            self.redis_port = cfg.redis_port or free_port()
            self.nodes = self.plan_nodes()  # the node ids name the Redis users
            self.gateway_port = cfg.gateway_port or free_port()  # the sidecars send a batch's prompts there
            self.start_redis(timeout_s)
            self.start_nodes(timeout_s)
            self.dispatcher_ports = [free_port() for _ in range(cfg.dispatchers)]
            self.dispatcher_metrics_ports = [free_port() for _ in range(cfg.dispatchers)]
            for i in range(cfg.dispatchers):
                self.dispatcher_procs.append(self.start_dispatcher(i, timeout_s))
            self.envoy = self.start_envoy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def plan_nodes(self) -> list[NodeProcs]:
        cfg = self.config
        nodes = [NodeProcs(f"p{i}", Role.PREFILL, free_port(), None) for i in range(cfg.prefill_nodes)]
        nodes += [NodeProcs(f"d{i}", Role.DECODE, free_port(), free_port()) for i in range(cfg.decode_nodes)]
        if cfg.kv_events:
            for node in nodes:
                node.kv_events = kv_events_config(free_port(), free_port())
        return nodes

    def _build_model(self) -> Path:
        from kairos.launcher.tinymodel import build_tiny_model

        return build_tiny_model(self.workdir / "model")

    def _py(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def _log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def start_redis(self, timeout_s: float = 30.0) -> ManagedProcess:
        """Start redis-server (again, after a fault: with the same users and passwords)."""
        if self.redis_setup is None:
            self.redis_setup = RedisSetup.create(
                self.workdir / "redis",
                self.redis_port,
                [n.node_id for n in self.nodes],
                host=self.config.redis_host,
                tls=self.config.redis_tls,
            )
        options = self.redis_setup.server_options()
        # With ACL users (default off) or TLS, a raw PING gets no PONG: a connection is the sign.
        ready = tcp_ready(LOOPBACK, self.redis_port)
        self.redis = self.group.start(redis_process(options, self._log("redis"), ready=ready), timeout_s)
        return self.redis

    def start_nodes(self, timeout_s: float = 60.0) -> None:
        for node in self.nodes:
            self.start_node(node, timeout_s)

    def start_node(self, node: NodeProcs, timeout_s: float = 60.0) -> None:
        node.engine = self.group.start(self.engine_process(node), timeout_s)
        self.start_agents(node, timeout_s)

    def state_url(self, node: NodeProcs) -> str:
        """Where the node's heartbeat publisher reads the engine state."""
        return node.url  # the emulated node serves /kairos/state itself

    def engine_process(self, node: NodeProcs) -> ManagedProcess:
        cfg = self.config
        step_tokens = cfg.prefill_step_tokens if node.role == Role.PREFILL else cfg.decode_step_tokens
        return ManagedProcess(
            f"{node.node_id}-vllm",
            self._py(
                "kairos.sim.emulated_vllm",
                "--node-id",
                node.node_id,
                "--role",
                node.role,
                "--host",
                LOOPBACK,
                "--port",
                str(node.vllm_port),
                "--model-dir",
                str(self.model_dir),
                "--model",
                cfg.model_name,
                "--profile",
                cfg.profile,
                "--time-scale",
                str(cfg.time_scale),
                "--max-model-len",
                str(cfg.max_model_len),
                "--max-step-tokens",
                str(step_tokens),
                "--kv-capacity-tokens",
                str(cfg.kv_capacity_tokens),
                *self._kv_events_args(node),
                # As every real node Kairos launches: usage says what the node found cached.
                "--enable-prompt-tokens-details",
                "--log-level",
                cfg.log_level,
            ),
            self._log(f"{node.node_id}-vllm"),
            ready=http_ready(f"http://{node.url}/health"),
        )

    def start_agents(self, node: NodeProcs, timeout_s: float = 30.0) -> None:
        """The sidecar (decode nodes) and the heartbeat publisher beside a running engine."""
        if node.role == Role.DECODE:
            node.sidecar = self.group.start(
                ManagedProcess(
                    f"{node.node_id}-sidecar",
                    self._py(
                        "kairos.nodeagent.sidecar",
                        "--host",
                        LOOPBACK,
                        "--port",
                        str(node.sidecar_port),
                        "--local-vllm",
                        node.url,
                        "--allow-prefill",
                        ",".join(n.url for n in self.nodes if n.role == Role.PREFILL),
                        "--gateway",
                        self.gateway_url.removeprefix("http://"),
                        "--log-level",
                        self.config.log_level,
                    ),
                    self._log(f"{node.node_id}-sidecar"),
                    ready=tcp_ready(LOOPBACK, node.sidecar_port or 0),
                    env=self.agent_env(node),  # its Redis URL: TTFT feedback for the dispatchers
                ),
                timeout_s,
            )
        node.publisher = self.start_publisher(node, timeout_s)

    def start_publisher(self, node: NodeProcs, timeout_s: float = 30.0) -> ManagedProcess:
        return self.group.start(
            ManagedProcess(
                f"{node.node_id}-heartbeat",
                self.publisher_argv(node),
                self._log(f"{node.node_id}-heartbeat"),
                env=self.agent_env(node),
            ),
            timeout_s,
        )

    def publisher_argv(self, node: NodeProcs) -> list[str]:
        return self._py(
            "kairos.nodeagent.heartbeat",
            "--node-id",
            node.node_id,
            "--role",
            node.role,
            "--url",
            node.url,
            "--sidecar",
            node.sidecar_url,
            "--state-url",
            self.state_url(node),
            "--period-ms",
            str(self.config.heartbeat_ms),
            *self._kv_events_args(node),
            "--log-level",
            self.config.log_level,
        )

    @staticmethod
    def _kv_events_args(node: NodeProcs) -> list[str]:
        """The engine's flag and its publisher's, the same JSON: the publisher advertises the
        sockets the engine binds, at the node's host."""
        return [] if node.kv_events is None else ["--kv-events-config", node.kv_events.to_json()]

    def agent_env(self, node: NodeProcs) -> dict[str, str]:
        """The environment of a node's publisher and sidecar: the Redis URL of the node's own
        user, which may write only that node's heartbeat key and the feedback stream."""
        return self._redis_setup().node_env(node.node_id, node.role)

    def start_dispatcher(self, index: int, timeout_s: float = 60.0) -> ManagedProcess:
        cfg = self.config
        port, metrics_port = self.dispatcher_ports[index], self.dispatcher_metrics_ports[index]
        proc = ManagedProcess(
            f"dispatcher{index}",
            self._py(
                "kairos.extproc",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--model-dir",
                str(self.model_dir),
                "--profile",
                cfg.profile,
                "--profile-reload-s",
                str(cfg.profile_reload_s),
                "--policy",
                cfg.policy,
                "--alpha",
                str(cfg.alpha),
                "--beta",
                str(cfg.beta),
                "--tbt-slo-ms",
                str(cfg.tbt_slo_ms),
                "--ttft-slo-s",
                str(cfg.ttft_slo_s),
                "--max-model-len",
                str(cfg.max_model_len),
                "--dispatcher-id",
                f"dispatcher{index}",
                "--fallback-prefill",
                ",".join(f"{n.node_id}={n.url}" for n in self.nodes if n.role == Role.PREFILL),
                "--fallback-decode",
                ",".join(f"{n.node_id}={n.url}+{n.sidecar_url}" for n in self.nodes if n.role == Role.DECODE),
                "--admit-nodes",  # the cluster's own nodes only, at their own addresses
                "listed",
                "--log-level",
                cfg.log_level,
            ),
            self._log(f"dispatcher{index}"),
            ready=http_ready(f"http://{LOOPBACK}:{metrics_port}/health"),
            env={DISPATCHER_ENV: self._redis_setup().dispatcher_url},
        )
        return self.group.start(proc, timeout_s)

    def start_envoy(self, timeout_s: float = 60.0) -> ManagedProcess:
        admin_port = self.envoy_admin_port = free_port()
        settings = EnvoySettings(
            listen_host=self.config.gateway_host,
            listen_port=self.gateway_port,
            admin_port=admin_port,
            dispatchers=tuple(f"{LOOPBACK}:{p}" for p in self.dispatcher_ports),
            sidecars=tuple(n.sidecar_url for n in self.nodes if n.role == Role.DECODE),
        )
        envoy = gateway_process("envoy", settings, self.workdir / "envoy.yaml", self._log("envoy"))
        return self.group.start(envoy, timeout_s)

    def prometheus_targets(self) -> list[dict[str, Any]]:
        """Every metrics endpoint of the cluster in Prometheus's ``file_sd`` format: dispatchers,
        decode sidecars (their own path) and node engines, labelled by job, node and role."""
        groups: list[dict[str, Any]] = [
            {
                "targets": [f"{LOOPBACK}:{port}" for port in self.dispatcher_metrics_ports],
                "labels": {"job": "kairos-dispatcher"},
            },
        ]
        for node in self.nodes:
            labels = {"node": node.node_id, "role": str(node.role)}
            groups.append({"targets": [node.url], "labels": {"job": "kairos-node", **labels}})
            if node.sidecar_port:
                groups.append(
                    {
                        "targets": [node.sidecar_url],
                        "labels": {"job": "kairos-sidecar", "__metrics_path__": SIDECAR_METRICS_PATH, **labels},
                    }
                )
        return groups

    def write_prometheus_targets(self, path: Path) -> Path:
        """Write :meth:`prometheus_targets` whole (Prometheus re-reads the file when it changes)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.prometheus_targets(), indent=2))
        tmp.replace(path)
        return path

    def nodes_unseen(self) -> list[str]:
        """Ids of the cluster's nodes that some dispatcher does not route on yet: absent from its
        ``/nodes`` view, stale there, or there from the static node lists only (no heartbeat yet: a
        dispatcher uses them while Redis answers without one); a dispatcher that does not answer
        sees none of them."""
        seen_by_all = {n.node_id for n in self.nodes}
        for port in self.dispatcher_metrics_ports:
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/nodes", timeout=2.0) as resp:
                    report = json.load(resp)
                seen_by_all &= {n["id"] for n in report["nodes"] if not n["stale"] and n["from_redis"]}
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
                seen_by_all = set()
        return [n.node_id for n in self.nodes if n.node_id not in seen_by_all]

    def wait_for_heartbeats(
        self,
        timeout_s: float = 15.0,
        *,
        stop: threading.Event | None = None,
        on_waiting: Callable[[list[str]], None] | None = None,
    ) -> None:
        """Until every dispatcher routes on every node with a fresh heartbeat, so that the first
        request sees the whole cluster. ``on_waiting`` hears each new list of nodes still missing;
        ``stop`` ends the wait early. Raises :class:`ProcessError` after ``timeout_s``."""
        stop = stop or threading.Event()
        deadline, said = time.monotonic() + timeout_s, None
        while not stop.is_set():
            unseen = self.nodes_unseen()
            if not unseen:
                return
            if unseen != said and on_waiting is not None:
                on_waiting(unseen)
            said = unseen
            if time.monotonic() >= deadline:
                raise ProcessError(
                    f"the dispatchers have no fresh heartbeat from {', '.join(unseen)} after {timeout_s:g} s"
                )
            stop.wait(0.1)

    # -- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        self.group.stop_all()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
