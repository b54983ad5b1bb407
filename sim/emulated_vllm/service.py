"""The emulated node's start-up: the command line, the application as it is served, and the service
(``python -m kairos.sim.emulated_vllm``, ``kairos emulated-node``)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from kairos.common.runtime import Service, announce_listening, serving
from kairos.sim.emulated_vllm.app import build_app
from kairos.sim.emulated_vllm.config import SOURCE, EmulatedNodeConfig

log = logging.getLogger(__package__)

# The request head vLLM's server reads (uvicorn's h11 limits as vLLM sets them by default:
# H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT, H11_MAX_HEADER_COUNT_DEFAULT); aiohttp's own defaults
# (8190 bytes a header, 128 headers) would refuse, with a text/plain 400, heads vLLM serves.
VLLM_MAX_HEAD_BYTES = 4 * 1024 * 1024
VLLM_MAX_HEADERS = 256


def app_runner(config: EmulatedNodeConfig) -> web.AppRunner:
    """The node's application, served as vLLM serves: idle connections closed after
    ``keep_alive_timeout_s``, a request whose client leaves aborted (vLLM's
    ``with_cancellation``: a non-streaming one too, which has no byte to fail on before its end),
    and request heads read up to vLLM's limits."""
    return web.AppRunner(
        build_app(config),
        access_log=None,
        keepalive_timeout=config.keep_alive_timeout_s,
        handler_cancellation=True,
        max_line_size=VLLM_MAX_HEAD_BYTES,  # one header may take the whole head
        max_field_size=VLLM_MAX_HEAD_BYTES,
        max_headers=VLLM_MAX_HEADERS,
    )


async def serve(config: EmulatedNodeConfig, stop: asyncio.Event) -> None:
    async with serving(app_runner(config), config.host, config.port) as (host, port):
        announce_listening(host, port)
        await stop.wait()
        log.info("node %s: signal received, shutting down", config.node_id)


SERVICE = Service(
    name="emulated-node",
    description="An emulated vLLM node: vLLM's OpenAI API over the Kairos engine model, in wall time.",
    source=SOURCE,
    serve=serve,
)
build_parser = SERVICE.parser
main = SERVICE.main
