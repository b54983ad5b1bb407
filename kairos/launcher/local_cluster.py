"""A whole Kairos cluster on one machine: redis-server, N prefill + M decode emulated vLLM
nodes with their heartbeat publishers, a sidecar per decode node, the dispatcher (one or more
replicas) and Envoy. Used by the end-to-end tests and by ``kairos up``.

Every part is a real separate process talking over loopback, so the cluster behaves like a
deployment: killing a node, Redis or the dispatcher is a real fault. Redis requires a credential
(:mod:`kairos.launcher.redis_setup`): each node's agents, the dispatchers and the cluster itself
(:attr:`LocalCluster.redis_url`) have their own ACL user, given to each child in its environment.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kairos.common import defaults
from kairos.common.config import ConfigSource, internal, part, setting, with_settings
from kairos.common.contracts import HEARTBEAT_PERIOD_S, SIDECAR_METRICS_PATH, Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventsConfig
from kairos.common.runtime import LOG_LEVELS
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.extproc.config import DispatcherConfig
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
from kairos.nodeagent.heartbeat import SOURCE as HEARTBEAT
from kairos.nodeagent.heartbeat import PublisherConfig
from kairos.nodeagent.sidecar.config import SOURCE as SIDECAR
from kairos.nodeagent.sidecar.config import SidecarConfig
from kairos.sim.emulated_vllm.config import SOURCE as EMULATED_NODE
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig

LOOPBACK = "127.0.0.1"


# What the cluster gives each dispatcher replica and each sidecar itself: their addresses, their
# peers and Redis (its credential in their environment), not a user's settings.
_PER_DISPATCHER = (
    "host",
    "port",
    "metrics_port",
    "model_dir",
    "redis_url",
    "dispatcher_id",
    "fallback_prefill",
    "fallback_decode",
    "admit_nodes",
)
_PER_SIDECAR = ("host", "port", "local_vllm", "allowed_prefill_hosts", "redis_url", "gateway")


@dataclass(frozen=True)
class LocalClusterConfig:
    """Topology and knobs of a local cluster; port 0 means "pick a free one". Its settings are
    ``kairos up``'s flags, ``KAIROS_CLUSTER_*`` variables and the YAML section ``cluster``; the
    dispatchers' and the sidecars' own settings join them by name (``--alpha``, ``--hop1-timeout-s``)."""

    prefill_nodes: int = setting(2, help="prefill nodes")
    decode_nodes: int = setting(2, help="decode nodes, each with its sidecar")
    dispatchers: int = setting(1, help="dispatcher replicas behind Envoy")
    gateway_port: int = setting(8000, help="the gateway's (Envoy's) port (0: any free port)", flags=("--port",))
    # Loopback unless nodes on other machines must reach Redis (their publishers) and clients
    # must reach Envoy: then 0.0.0.0 or this machine's address.
    gateway_host: str = setting(LOOPBACK, help="Envoy's listen address", flags=("--host",))
    model_dir: str = setting("", help="the served model's tokenizer directory (a tiny Llama is built when empty)")
    model_name: str = setting("kairos-tiny-llama", help="the served model's name", flags=("--model",))
    time_scale: float = setting(1.0, help="emulated nodes run this many times faster than real time")
    kv_capacity_tokens: int = setting(defaults.KV_CAPACITY_TOKENS, help="each emulated node's KV cache, in tokens")
    prefill_step_tokens: int = setting(defaults.PREFILL_STEP_TOKENS, help="tokens per engine step on prefill nodes")
    decode_step_tokens: int = setting(defaults.DECODE_STEP_TOKENS, help="tokens per engine step on decode nodes")
    heartbeat_period_s: float = setting(HEARTBEAT_PERIOD_S, help="every node's heartbeat period")
    redis_port: int = setting(0, help="Redis port (0: any free port)")
    redis_host: str = setting(
        LOOPBACK, help="Redis listen address; other machines' heartbeat publishers need a reachable one"
    )
    redis_tls: bool = setting(
        False, help="Redis over TLS only (rediss://), with a CA made for this cluster (needs openssl)", form="switch"
    )
    # vLLM's --kv-events-config on two free ports per node, advertised in its heartbeat.
    kv_events: bool = setting(
        True, help="every node publishes its KV cache events, so the dispatchers see each node's prefix cache"
    )
    log_level: str = internal("INFO")  # every process's: the kairos command's --log-level
    dispatcher: DispatcherConfig = part(DispatcherConfig, help="every dispatcher replica", omit=_PER_DISPATCHER)
    sidecar: SidecarConfig = part(SidecarConfig, help="every decode node's sidecar", omit=_PER_SIDECAR)

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
        if not self.heartbeat_period_s > 0:
            raise ConfigError(f"heartbeat_period_s must be > 0, got {self.heartbeat_period_s}")

    # What the engines share with the dispatchers: the model they predict is the one they run.
    @property
    def profile(self) -> str:
        return self.dispatcher.profile

    @property
    def policy(self) -> str:
        return self.dispatcher.policy

    @property
    def max_model_len(self) -> int:
        return self.dispatcher.requests.limits.max_model_len


SOURCE = ConfigSource(LocalClusterConfig, section="cluster", env_prefix="KAIROS_CLUSTER_", module="kairos")


def cluster_config(*, log_level: str = "INFO", **settings: Any) -> LocalClusterConfig:
    """A cluster's config from settings by name (``cluster_config(policy="pd", alpha=1.3)``)."""
    # with_settings, not load_config's overrides: there None means "not given", here a value
    # (deflect_gate_share=None turns the gate off).
    return dataclasses.replace(with_settings(LocalClusterConfig(), **settings), log_level=log_level)


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
        engine = EmulatedNodeConfig(
            node_id=node.node_id,
            role=node.role,
            model_dir=str(self.model_dir),
            host=LOOPBACK,
            port=node.vllm_port,
            model=cfg.model_name,
            profile=cfg.profile,
            time_scale=cfg.time_scale,
            max_model_len=cfg.max_model_len,
            max_step_tokens=cfg.prefill_step_tokens if node.role == Role.PREFILL else cfg.decode_step_tokens,
            kv_capacity_tokens=cfg.kv_capacity_tokens,
            kv_events_config=None if node.kv_events is None else node.kv_events.to_json(),
            enable_prompt_tokens_details=True,  # as every real node Kairos launches: usage says what it found cached
        )
        name = f"{node.node_id}-vllm"
        return ManagedProcess(
            name,
            self.service_command(EMULATED_NODE, engine, name),
            self._log(name),
            ready=http_ready(f"http://{node.url}/health"),
        )

    def service_command(self, source: ConfigSource[Any], config: Any, name: str, *, secret: str = "") -> list[str]:
        """A service's process reading ``config`` from its YAML file (``workdir/config/NAME.yaml``);
        ``secret``: the setting its environment gives instead (a Redis URL with its password)."""
        path = self.workdir / "config" / f"{name}.yaml"
        source.write(path, config, skip=(secret,) if secret else ())
        return source.command(path, self.config.log_level)

    def start_agents(self, node: NodeProcs, timeout_s: float = 30.0) -> None:
        """The sidecar (decode nodes) and the heartbeat publisher beside a running engine."""
        if node.role == Role.DECODE:
            sidecar = with_settings(
                self.config.sidecar,
                host=LOOPBACK,
                port=node.sidecar_port,
                local_vllm=node.url,
                allowed_prefill_hosts=tuple(n.url for n in self.nodes if n.role == Role.PREFILL),
                gateway=self.gateway_url.removeprefix("http://"),
            )
            name = f"{node.node_id}-sidecar"
            node.sidecar = self.group.start(
                ManagedProcess(
                    name,
                    self.service_command(SIDECAR, sidecar, name, secret="redis_url"),
                    self._log(name),
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
        publisher = PublisherConfig(
            node_id=node.node_id,
            role=node.role,
            url=node.url,
            sidecar=node.sidecar_url,
            state_url=self.state_url(node),
            period_s=self.config.heartbeat_period_s,
            kv_events_config="" if node.kv_events is None else node.kv_events.to_json(),
        )
        return self.service_command(HEARTBEAT, publisher, f"{node.node_id}-heartbeat", secret="redis_url")

    def agent_env(self, node: NodeProcs) -> dict[str, str]:
        """The environment of a node's publisher and sidecar: the Redis URL of the node's own
        user, which may write only that node's heartbeat key and the feedback stream."""
        return self._redis_setup().node_env(node.node_id, node.role)

    def start_dispatcher(self, index: int, timeout_s: float = 60.0) -> ManagedProcess:
        cfg = self.config
        port, metrics_port = self.dispatcher_ports[index], self.dispatcher_metrics_ports[index]
        name = f"dispatcher{index}"
        dispatcher = with_settings(
            cfg.dispatcher,
            host=LOOPBACK,
            port=port,
            metrics_port=metrics_port,
            model_dir=str(self.model_dir),
            dispatcher_id=name,
            fallback_prefill=tuple(f"{n.node_id}={n.url}" for n in self.nodes if n.role == Role.PREFILL),
            fallback_decode=tuple(f"{n.node_id}={n.url}+{n.sidecar_url}" for n in self.nodes if n.role == Role.DECODE),
            admit_nodes="listed",  # the cluster's own nodes only, at their own addresses
        )
        proc = ManagedProcess(
            name,
            self.service_command(DISPATCHER, dispatcher, name, secret="redis_url"),
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
