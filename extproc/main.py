"""``python -m extproc`` / ``kairos dispatcher``: run the Kairos dispatcher (Envoy ext_proc).

Settings (:class:`kairos.extproc.config.DispatcherConfig`): defaults < ``--config`` YAML (section
``dispatcher``) < ``KAIROS_DISPATCHER_*`` environment < flags.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from aiohttp import web
from grpc_health.v1.health import aio as health_aio
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kairos.api.tokenizer import PromptTokenizer
from kairos.common.redis_client import redact_url
from kairos.common.runtime import Service, announce_listening, freeze_startup_heap
from kairos.core.latency import profile_path
from kairos.core.prefix_index import PrefixIndex
from kairos.core.view import ClusterTracker
from kairos.extproc.admission import AdmissionGate
from kairos.extproc.cluster import RedisClusterView
from kairos.extproc.config import SOURCE, DispatcherConfig
from kairos.extproc.dispatcher import Dispatcher, prefix_aware
from kairos.extproc.feedback import TtftFeedback
from kairos.extproc.kv_events import KvEventConsumer
from kairos.extproc.metrics import ClusterCollector, DispatcherMetrics, PrefixIndexCollector
from kairos.extproc.profile_watch import LoadedProfile, ProfileWatcher, load_initial
from kairos.extproc.server import BusyLimits, start_grpc_server

log = logging.getLogger("kairos.dispatcher")


async def serve(config: DispatcherConfig, stop: asyncio.Event) -> None:
    config.check_serving()
    profile, signature = load_initial(config.profile)
    tokenizer = PromptTokenizer.from_dir(Path(config.model_dir))
    metrics = DispatcherMetrics()
    metrics.set_profile(profile.models.name, profile.digest, profile.source)
    policies = config.policies(profile.models)
    clock = time.monotonic  # the view's and the prefix index's: a hit is judged fresh on the view's time
    kv_events = (
        KvEventConsumer(
            PrefixIndex(config.prefix_index_capacity_blocks, config.decider.stale_after_s),
            clock,
            config.kv_events_replay_timeout_s,
        )
        if prefix_aware(policies.policy)
        else None
    )
    tracker = ClusterTracker(dispatch_grace_s=config.dispatch_grace_s, link=profile.models.transfer)
    cluster = RedisClusterView(
        config.view,
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
        settings=config.requests,
        prefixes=kv_events,
        admission=AdmissionGate(cluster.view, metrics, config.admission_limits) if config.admission else None,
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
        redact_url(config.view.redis_url),
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


SERVICE = Service(
    name="dispatcher",
    description=__doc__.splitlines()[0],
    source=SOURCE,
    serve=serve,
)
build_parser = SERVICE.parser
main = SERVICE.main
