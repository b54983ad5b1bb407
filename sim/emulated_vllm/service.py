"""The emulated node's start-up: the command line, the application as it is served, and the service
(``python -m kairos.sim.emulated_vllm``, ``kairos emulated-node``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from aiohttp import web

from kairos.common.contracts import Role
from kairos.common.runtime import Service, announce_listening, flag_overrides, serving
from kairos.core.latency import DEFAULT_PROFILE
from kairos.sim.emulated_vllm.app import build_app
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig

log = logging.getLogger(__package__)

# The request head vLLM's server reads (uvicorn's h11 limits as vLLM sets them by default:
# H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT, H11_MAX_HEADER_COUNT_DEFAULT); aiohttp's own defaults
# (8190 bytes a header, 128 headers) would refuse, with a text/plain 400, heads vLLM serves.
VLLM_MAX_HEAD_BYTES = 4 * 1024 * 1024
VLLM_MAX_HEADERS = 256


ENV_PREFIX = "KAIROS_EMU_"


def build_parser() -> argparse.ArgumentParser:
    p = SERVICE.parser()
    p.add_argument("--node-id", dest="node_id")
    p.add_argument("--role", choices=[r.value for r in Role])
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--model-dir", dest="model_dir", help="model directory holding tokenizer.json")
    p.add_argument("--model", "--served-model-name", dest="model", help="served model id (default: --model-dir)")
    p.add_argument("--profile", help=f"latency profile name or JSON path (default {DEFAULT_PROFILE})")
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--max-step-tokens", "--max-num-batched-tokens", dest="max_step_tokens", type=int)
    p.add_argument("--kv-capacity-tokens", dest="kv_capacity_tokens", type=int)
    p.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int)
    p.add_argument("--time-scale", dest="time_scale", type=float, help="10 = ten times faster than real time")
    p.add_argument("--kv-hold-timeout-s", dest="kv_hold_timeout_s", type=float, help="wall seconds (vLLM: 480)")
    p.add_argument(
        "--keep-alive-timeout-s",
        dest="keep_alive_timeout_s",
        type=float,
        help="wall seconds an idle kept-alive connection stays open (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5)",
    )
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    p.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's prefix caching (default on; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument("--block-size", dest="block_size", type=int, help="tokens per KV block (default 16)")
    p.add_argument(
        "--enable-prompt-tokens-details",
        dest="enable_prompt_tokens_details",
        action="store_true",
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument("--kv-events-config", dest="kv_events_config", help="vLLM's KVEventsConfig as JSON")
    return p


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
    "emulated-node",
    "An emulated vLLM node: vLLM's OpenAI API over the Kairos engine model, in wall time.",
    EmulatedNodeConfig,
    None,
    ENV_PREFIX,
    serve,
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SERVICE.run(args, flag_overrides(args))
