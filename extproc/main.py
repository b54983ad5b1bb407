"""``python -m extproc`` / ``kairos dispatcher``: run the Kairos dispatcher (Envoy ext_proc).

Settings: defaults < ``--config`` YAML (section ``dispatcher``) < ``KAIROS_DISPATCHER_*``
environment < flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from grpc_health.v1.health import aio as health_aio
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kairos.api.openai_request import RequestLimits
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import defaults
from kairos.common.errors import ConfigError
from kairos.common.redis_client import redact_url
from kairos.common.runtime import Service, announce_listening, flag_overrides, freeze_startup_heap
from kairos.core.admission import AdmissionLimits
from kairos.core.algorithm import DEFAULT_CHUNK_CANDIDATES, DeciderConfig
from kairos.core.latency import DEFAULT_PROFILE, LatencyModels, profile_path
from kairos.core.policies import NoPrefillPoolPolicy, create_policy, validate_gateway_policy
from kairos.core.prefix_index import PrefixIndex
from kairos.core.view import ClusterTracker
from kairos.extproc.admission import AdmissionGate
from kairos.extproc.cluster import ClusterViewConfig, RedisClusterView
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings, Policies, prefix_aware
from kairos.extproc.feedback import DEFAULT_WINDOW, TtftFeedback
from kairos.extproc.kv_events import KvEventConsumer
from kairos.extproc.membership import MembershipConfig
from kairos.extproc.metrics import ClusterCollector, DispatcherMetrics, PrefixIndexCollector
from kairos.extproc.profile_watch import LoadedProfile, ProfileWatcher, load_initial
from kairos.extproc.server import BusyLimits, start_grpc_server

log = logging.getLogger("kairos.dispatcher")

_VIEW, _MEMBERSHIP = ClusterViewConfig(), MembershipConfig()  # their defaults are the dispatcher's


@dataclass(frozen=True)
class DispatcherConfig:
    """Everything the dispatcher process needs."""

    host: str = "127.0.0.1"
    port: int = 9000  # ext_proc gRPC
    metrics_port: int = 9100  # Prometheus /metrics, /health and /nodes (0 = off)
    redis_url: str = _VIEW.redis_url
    model_dir: str = ""  # the served model's tokenizer (tokenizer.json + tokenizer_config.json)
    profile: str = DEFAULT_PROFILE  # latency profile: packaged name or JSON path
    # A profile file is re-read when its (inode, mtime, size) changes, checked this often;
    # 0 = no periodic check (SIGHUP still reloads). Packaged profiles never change.
    profile_reload_s: float = 1.0
    # Rolling MAPE window (samples per path) of the sidecars' TTFT feedback; 0 = do not read it.
    ttft_feedback_window: int = DEFAULT_WINDOW
    policy: str = "kairos"  # a policy spec (kairos.core.policies): any but oracle, which is simulator-only
    alpha: float = defaults.ALPHA
    beta: float = defaults.BETA
    tbt_slo_ms: float = defaults.TBT_SLO_S * 1e3  # the flag's unit
    ttft_slo_s: float = defaults.TTFT_SLO_S
    chunk_candidates: tuple[int, ...] = DEFAULT_CHUNK_CANDIDATES
    max_pending_deflections: int | None = defaults.MAX_PENDING_DEFLECTIONS
    node_step_guard: bool = True
    max_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES
    max_model_len: int = defaults.MAX_MODEL_LEN
    dispatcher_id: str = ""  # reservation owner; a random id when empty
    # The cluster view (kairos.extproc.cluster and .membership say what each does).
    poll_s: float = _VIEW.poll_s
    scan_every_polls: int = _VIEW.scan_every_polls
    redis_timeout_s: float = _VIEW.redis_timeout_s
    reservation_ttl_s: float = _VIEW.reservation_ttl_s
    hear_promises: bool = _VIEW.hear_promises
    stale_after_s: float = _MEMBERSHIP.stale_after_s  # the decider gets the same value
    recovery_grace_s: float = _MEMBERSHIP.recovery_grace_s
    forget_malformed_after_s: float = _MEMBERSHIP.forget_malformed_after_s
    last_resort_s: float = _MEMBERSHIP.last_resort_s
    # A dispatch stays in the overlay until a beat taken this long after it arrives: one poll of
    # delay on our side plus the sidecar hop.
    dispatch_grace_s: float = 0.1
    # Used only while Redis has never answered: "id=host:port" for prefill vLLMs and
    # "id=host:port" of decode sidecars (plain P/D routing until heartbeats arrive).
    fallback_prefill: tuple[str, ...] = ()
    fallback_decode: tuple[str, ...] = ()
    # "listed": only the nodes of those lists join, with the role and addresses listed; heartbeats
    # of others are ignored and counted (kairos_dispatcher_heartbeats_rejected_total).
    admit_nodes: str = _MEMBERSHIP.admit_nodes
    # The nodes' prefix caches, from the KV events their heartbeats advertise (subscribed only
    # under a prefix-aware policy): the blocks indexed per node (oldest dropped past it), and how
    # long a replay may take before the node's index resets instead.
    prefix_index_capacity_blocks: int = defaults.PREFIX_INDEX_CAPACITY_BLOCKS
    kv_events_replay_timeout_s: float = defaults.KV_EVENTS_REPLAY_TIMEOUT_S
    # Admission control (kairos.core.admission), and shedding when the dispatcher itself is too
    # busy to decide in time (kairos.extproc.server.BusyLimits): off decides every request,
    # however many are in flight or open (the gateway then holds what Envoy's limits let in).
    admission: bool = True
    admission_max_wait_s: float = defaults.ADMISSION_MAX_WAIT_S

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("model_dir is required: the directory with the served model's tokenizer.json")
        validate_gateway_policy(self.policy)
        if not 0 <= self.profile_reload_s < float("inf"):
            raise ConfigError(f"profile_reload_s must be >= 0 (0 = off), got {self.profile_reload_s}")
        if self.ttft_feedback_window < 0:
            raise ConfigError(f"ttft_feedback_window must be >= 0 (0 = off), got {self.ttft_feedback_window}")
        if not self.dispatch_grace_s >= 0:
            raise ConfigError(f"dispatch_grace_s must be >= 0, got {self.dispatch_grace_s}")
        if self.prefix_index_capacity_blocks < 1:
            raise ConfigError(f"prefix_index_capacity_blocks must be >= 1, got {self.prefix_index_capacity_blocks}")
        if not self.kv_events_replay_timeout_s > 0:
            raise ConfigError(f"kv_events_replay_timeout_s must be > 0, got {self.kv_events_replay_timeout_s}")
        self.cluster_view()  # its own cross-field checks, at start-up
        self.admission_limits()

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(max_wait_s=self.admission_max_wait_s)

    def cluster_view(self) -> ClusterViewConfig:
        return ClusterViewConfig(
            redis_url=self.redis_url,
            poll_s=self.poll_s,
            scan_every_polls=self.scan_every_polls,
            redis_timeout_s=self.redis_timeout_s,
            reservation_ttl_s=self.reservation_ttl_s,
            hear_promises=self.hear_promises,
            membership=MembershipConfig(
                stale_after_s=self.stale_after_s,
                recovery_grace_s=self.recovery_grace_s,
                forget_malformed_after_s=self.forget_malformed_after_s,
                last_resort_s=self.last_resort_s,
                fallback_prefill=self.fallback_prefill,
                fallback_decode=self.fallback_decode,
                admit_nodes=self.admit_nodes,
            ),
        )

    def decider(self) -> DeciderConfig:
        return DeciderConfig(
            alpha=self.alpha,
            beta=self.beta,
            tbt_slo_s=self.tbt_slo_ms / 1e3,
            ttft_slo_s=self.ttft_slo_s,
            chunk_candidates=self.chunk_candidates,
            stale_after_s=self.stale_after_s,
            max_pending_deflections=self.max_pending_deflections,
            node_step_guard=self.node_step_guard,
        )

    def policies(self, models: LatencyModels) -> Policies:
        """The routing policies on ``models`` (rebuilt whole on every profile reload)."""
        decider = self.decider()
        return Policies(
            create_policy(self.policy, models, decider),
            create_policy("pd", models, decider),
            NoPrefillPoolPolicy(models, decider),
        )


async def serve(config: DispatcherConfig, stop: asyncio.Event) -> None:
    profile, signature = load_initial(config.profile)
    tokenizer = PromptTokenizer.from_dir(Path(config.model_dir))
    metrics = DispatcherMetrics()
    metrics.set_profile(profile.models.name, profile.digest, profile.source)
    policies = config.policies(profile.models)
    clock = time.monotonic  # the view's and the prefix index's: a hit is judged fresh on the view's time
    kv_events = (
        KvEventConsumer(
            PrefixIndex(config.prefix_index_capacity_blocks, config.stale_after_s),
            clock,
            config.kv_events_replay_timeout_s,
        )
        if prefix_aware(policies.policy)
        else None
    )
    tracker = ClusterTracker(dispatch_grace_s=config.dispatch_grace_s, link=profile.models.transfer)
    cluster = RedisClusterView(
        config.cluster_view(),
        tracker=tracker,
        clock=clock,
        registry=metrics.registry,
        feedback=TtftFeedback(metrics, config.ttft_feedback_window) if config.ttft_feedback_window else None,
        kv_events=kv_events,
    )
    metrics.registry.register(ClusterCollector(cluster))
    if kv_events is not None:
        metrics.registry.register(PrefixIndexCollector(kv_events))
    dispatcher = Dispatcher(
        tokenizer=tokenizer,
        policy=policies.policy,
        keep_policy=policies.keep_policy,
        no_prefill_policy=policies.no_prefill,
        cluster=cluster,
        metrics=metrics,
        settings=DispatchSettings(
            limits=RequestLimits(max_body_bytes=config.max_body_bytes, max_model_len=config.max_model_len),
            dispatcher_id=config.dispatcher_id,
        ),
        prefixes=kv_events,
        admission=AdmissionGate(cluster.view, metrics, config.admission_limits()) if config.admission else None,
    )

    def use(loaded: LoadedProfile) -> None:
        # Built in full first, then one assignment: the next decision reads the new models.
        policies = config.policies(loaded.models)
        tracker.relink(loaded.models.transfer)  # the incoming keeps' link queue, by the new transfer model
        dispatcher.policies = policies

    path = profile_path(config.profile)
    watcher = (
        ProfileWatcher(path, profile, signature, use, metrics, config.profile_reload_s) if path is not None else None
    )
    await cluster.start()
    health = health_aio.HealthServicer()
    busy = BusyLimits() if config.admission else None  # the dispatcher's own CPU, before the budget's
    server, port = await start_grpc_server(dispatcher, config.host, config.port, health, busy)
    runner = await _start_metrics(metrics, cluster, config) if config.metrics_port else None
    if watcher is not None:
        await watcher.start()
    hup = _on_sighup(watcher, profile)
    log.info(
        "dispatcher %s listening on %s:%d (policy %s, profile %s from %s, redis %s; prefix caches %s)",
        dispatcher.owner,
        config.host,
        port,
        config.policy,
        profile.label,
        profile.source,
        redact_url(config.redis_url),
        "from the nodes' KV events" if kv_events is not None else "not read (the policy is cache-blind)",
    )
    freeze_startup_heap()  # before the ready line: Envoy may send traffic at once
    announce_listening(config.host, port)
    try:
        await stop.wait()
    finally:
        log.info("dispatcher stopping")
        if hup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if watcher is not None:
            await watcher.stop()
        # NOT_SERVING first: Envoy's next health check moves new requests to another replica
        # while the streams in flight here finish within the grace period.
        await health.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        if runner is not None:
            await runner.cleanup()
        await cluster.stop()
        if kv_events is not None:
            await kv_events.close()
        dispatcher.close()


def _on_sighup(watcher: ProfileWatcher | None, profile: LoadedProfile) -> bool:
    """SIGHUP re-reads the profile file; True if the handler is installed (main thread only)."""

    def packaged() -> None:
        log.info("SIGHUP: profile %s is packaged and never changes; nothing to reload", profile.label)

    try:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, watcher.request_reload if watcher is not None else packaged
        )
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no SIGHUP here
        return False
    return True


async def _start_metrics(
    metrics: DispatcherMetrics, cluster: RedisClusterView, config: DispatcherConfig
) -> web.AppRunner:
    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        # Up even when degraded (P/D routing still works); the body says which.
        return web.json_response({"status": "degraded" if cluster.degraded else "ok"})

    async def nodes(_: web.Request) -> web.Response:
        return web.json_response(cluster.nodes_report())

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/health", health)
    app.router.add_get("/nodes", nodes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.metrics_port).start()
    return runner


SERVICE = Service("dispatcher", __doc__.splitlines()[0], DispatcherConfig, "dispatcher", "KAIROS_DISPATCHER_", serve)


def build_parser() -> argparse.ArgumentParser:
    p = SERVICE.parser()
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int)
    p.add_argument(
        "--redis",
        dest="redis_url",
        help="redis:// or rediss:// URL; with a password, better in $KAIROS_DISPATCHER_REDIS_URL (not in ps)",
    )
    p.add_argument("--model-dir")
    p.add_argument("--profile")
    p.add_argument("--profile-reload-s", type=float, help="check a profile file for changes this often (0 = off)")
    p.add_argument("--ttft-feedback-window", type=int, help="samples in the rolling TTFT MAPE (0 = off)")
    p.add_argument("--policy")
    p.add_argument("--alpha", type=float)
    p.add_argument("--beta", type=float)
    p.add_argument("--tbt-slo-ms", type=float)
    p.add_argument("--ttft-slo-s", type=float)
    p.add_argument("--chunks", dest="chunk_candidates", help="e.g. 2048,1024,512,256,128")
    p.add_argument("--max-pending-deflections", help="an integer, or none to lift the limit")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--dispatcher-id")
    p.add_argument("--fallback-prefill", help="id=host:port,... used only before Redis first answers")
    p.add_argument("--fallback-decode", help="id=host:port,... (sidecars) used only before Redis first answers")
    p.add_argument(
        "--admit-nodes",
        choices=("any", "listed"),
        help="listed: only the fallback lists' nodes join, with their listed role and addresses (default any)",
    )
    p.add_argument(
        "--admission",
        choices=("on", "off"),
        help="on (default): a bounded in-flight budget, 429 past it; off: decide every request",
    )
    p.add_argument("--admission-max-wait-s", type=float, help="longest wait for a seat before a 429 (default 1)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SERVICE.run(args, flag_overrides(args))
