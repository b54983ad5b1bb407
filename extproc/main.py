"""``python -m extproc`` / ``kairos dispatcher``: run the Kairos dispatcher (Envoy ext_proc).

Settings: defaults < ``--config`` YAML (section ``dispatcher``) < ``KAIROS_DISPATCHER_*``
environment < flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from extproc.algorithm import DEFAULT_CHUNK_CANDIDATES, DeciderConfig
from extproc.cluster import ClusterViewConfig, RedisClusterView
from extproc.dispatcher import Dispatcher, DispatchSettings
from extproc.latency import DEFAULT_PROFILE, load_profile
from extproc.metrics import ClusterCollector, DispatcherMetrics
from extproc.openai_request import RequestLimits
from extproc.policies import make_policy
from extproc.server import start_grpc_server
from extproc.tokenizer import PromptTokenizer
from extproc.view import ClusterTracker
from kairos.config import load_config
from kairos.errors import ConfigError
from kairos.runtime import stop_on_signals

log = logging.getLogger("kairos.dispatcher")


@dataclass(frozen=True)
class DispatcherConfig:
    """Everything the dispatcher process needs."""

    host: str = "127.0.0.1"
    port: int = 9000  # ext_proc gRPC
    metrics_port: int = 9100  # Prometheus /metrics and /health (0 = off)
    redis_url: str = "redis://127.0.0.1:6379/0"
    model_dir: str = ""  # the served model's tokenizer (tokenizer.json + tokenizer_config.json)
    profile: str = DEFAULT_PROFILE  # latency profile: packaged name or JSON path
    policy: str = "kairos"  # routing policy spec: kairos, pd, oracle is simulator-only
    alpha: float = 1.3
    beta: float = 1.0
    tbt_slo_ms: float = 70.0
    ttft_slo_s: float = 4.0
    chunk_candidates: tuple[int, ...] = DEFAULT_CHUNK_CANDIDATES
    stale_after_s: float = 0.35
    max_pending_deflections: int | None = 1
    node_step_guard: bool = True
    max_body_bytes: int = 8 * 1024 * 1024
    max_model_len: int = 32768
    dispatcher_id: str = ""  # reservation owner; a random id when empty
    # Used only while Redis has never answered: "id=host:port" for prefill vLLMs and
    # "id=host:port" of decode sidecars (plain P/D routing until heartbeats arrive).
    fallback_prefill: tuple[str, ...] = ()
    fallback_decode: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("model_dir is required: the directory with the served model's tokenizer.json")
        if self.policy.split(":", 1)[0] == "oracle":
            raise ConfigError("the oracle policy needs the simulator's true state; use kairos or pd")

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


async def serve(config: DispatcherConfig, stop: asyncio.Event) -> None:
    models = load_profile(config.profile)
    tokenizer = PromptTokenizer.from_dir(Path(config.model_dir))
    metrics = DispatcherMetrics()
    cluster = RedisClusterView(
        ClusterViewConfig(
            redis_url=config.redis_url,
            stale_after_s=config.stale_after_s,
            fallback_prefill=config.fallback_prefill,
            fallback_decode=config.fallback_decode,
        ),
        # A dispatch stays in the overlay until a beat taken well after it arrives: one poll of
        # delay on our side plus the sidecar hop.
        tracker=ClusterTracker(dispatch_grace_s=0.1),
        registry=metrics.registry,
    )
    metrics.registry.register(ClusterCollector(cluster))
    decider = config.decider()
    dispatcher = Dispatcher(
        tokenizer=tokenizer,
        policy=make_policy(config.policy, models, decider),
        keep_policy=make_policy("pd", models, decider),
        cluster=cluster,
        metrics=metrics,
        settings=DispatchSettings(
            limits=RequestLimits(max_body_bytes=config.max_body_bytes, max_model_len=config.max_model_len),
            dispatcher_id=config.dispatcher_id,
        ),
    )
    await cluster.start()
    server, port = await start_grpc_server(dispatcher, config.host, config.port)
    runner = await _start_metrics(metrics, cluster, config) if config.metrics_port else None
    log.info(
        "dispatcher %s listening on %s:%d (policy %s, profile %s, redis %s)",
        dispatcher.owner,
        config.host,
        port,
        config.policy,
        models.name,
        config.redis_url,
    )
    print(f"listening on {config.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("dispatcher stopping")
        await server.stop(grace=1.0)
        if runner is not None:
            await runner.cleanup()
        await cluster.stop()
        dispatcher.close()


async def _start_metrics(
    metrics: DispatcherMetrics, cluster: RedisClusterView, config: DispatcherConfig
) -> web.AppRunner:
    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        # Up even when degraded (P/D routing still works); the body says which.
        return web.json_response({"status": "degraded" if cluster.degraded else "ok"})

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.metrics_port).start()
    return runner


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos dispatcher", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="YAML file with a 'dispatcher' section")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--redis", dest="redis_url")
    p.add_argument("--model-dir")
    p.add_argument("--profile")
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
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level")}
    try:
        config = load_config(
            DispatcherConfig, args.config, section="dispatcher", env_prefix="KAIROS_DISPATCHER_", overrides=overrides
        )
    except ConfigError as exc:
        print(f"kairos dispatcher: error: {exc.message}", file=sys.stderr)
        return 2

    async def run() -> None:
        await serve(config, stop_on_signals())

    asyncio.run(run())
    return 0
