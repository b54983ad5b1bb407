"""The decode-node sidecar: carries out the dispatcher's decision beside one decode node's vLLM.

Its start-up: the command line, the app as it is served, and the service (``python -m
kairos.nodeagent.sidecar``, ``kairos sidecar``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from aiohttp import web

from kairos.common import defaults
from kairos.common.redis_client import redact_url
from kairos.common.runtime import Service, announce_listening, freeze_startup_heap, serving
from kairos.nodeagent.sidecar.app import build_app
from kairos.nodeagent.sidecar.config import SOURCE, SidecarConfig

log = logging.getLogger(__package__)

_SHUTDOWN_GRACE_S = 30.0  # in-flight streams get this long to finish on SIGTERM
# A request line or header may take this much (aiohttp's default: 8190 bytes): Envoy passes heads
# of up to 60 KiB (its max_request_headers_kb default) and vLLM's server reads 4 MiB, so the
# sidecar is never the one to refuse a request, with aiohttp's bare text/plain 400.
_MAX_REQUEST_LINE_BYTES = 64 * 1024


def app_runner(
    config: SidecarConfig,
    allowlist: Callable[[], Collection[str]] | None = None,
    *,
    shutdown_timeout: float = _SHUTDOWN_GRACE_S,
) -> web.AppRunner:
    """The sidecar's app as it is served. A handler is cancelled when its client leaves (as
    vLLM's ``with_cancellation`` does): its hop's connection is dropped and vLLM aborts the
    request. A stream would notice at its next write, but a non-streaming reply has no byte to
    write before the end: without this, a client that left would keep its request generating
    on the node to the last token."""
    # The access log would add an INFO line per request; the DEBUG timing line covers it.
    return web.AppRunner(
        build_app(config, allowlist),
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=defaults.SIDECAR_KEEP_ALIVE_S,  # Envoy's idle close comes first
        handler_cancellation=True,
        max_line_size=_MAX_REQUEST_LINE_BYTES,
        max_field_size=_MAX_REQUEST_LINE_BYTES,
    )


async def serve(config: SidecarConfig, stop: asyncio.Event) -> None:
    async with serving(app_runner(config), config.host, config.port) as (host, port):
        freeze_startup_heap()  # before the ready line: a supervisor may send traffic at once
        announce_listening(host, port)
        log.info(
            "sidecar for local vLLM %s; static prefill allowlist %s; TTFT feedback %s",
            config.local_vllm,
            list(config.allowed_prefill_hosts) or "(none)",
            f"to {redact_url(config.redis_url)}" if config.redis_url else "off (no --redis)",
        )
        await stop.wait()
        log.info("stopping: finishing in-flight requests (up to %gs)", _SHUTDOWN_GRACE_S)


SERVICE = Service(
    name="sidecar",
    description=__doc__.split("\n\n")[0],
    source=SOURCE,
    serve=serve,
    uvloop=True,
)
build_parser = SERVICE.parser
main = SERVICE.main  # until SIGTERM or SIGINT; settings: defaults < YAML < KAIROS_SIDECAR_* env < flags
