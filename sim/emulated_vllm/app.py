"""The node's aiohttp application: its routes, and every error answered with the OpenAI error JSON."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kairos.api.openai_request import NotFoundError, PayloadTooLargeError
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.contracts.api import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, HEALTH_PATH, MODELS_PATH
from kairos.common.errors import InvalidRequestError, KairosError, NoHealthyNodeError
from kairos.common.http_errors import error_body, error_json, error_status
from kairos.core.latency import load_profile
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig
from kairos.sim.emulated_vllm.kv_transfer import KV_PULL_PATH
from kairos.sim.emulated_vllm.node import EmulatedNode
from kairos.sim.realtime import EngineStoppedError

log = logging.getLogger(__package__)

NODE_KEY = web.AppKey("node", "EmulatedNode")  # the application's EmulatedNode (tests reach into it)


def _http_error(request: web.Request, exc: web.HTTPException) -> KairosError:
    if exc.status == 404:
        return NotFoundError(f"no such endpoint: {request.method} {request.path}")
    if exc.status == 413:
        return PayloadTooLargeError(f"request body is over the limit: {exc.text or exc.reason}")
    return InvalidRequestError(exc.text or exc.reason)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error is answered with the OpenAI error JSON of kairos.common.http_errors."""
    try:
        try:
            return await handler(request)
        except EngineStoppedError as exc:
            raise NoHealthyNodeError(str(exc)) from None
    except KairosError as exc:
        status = error_status(exc)
        level = logging.WARNING if status >= 500 else logging.DEBUG
        log.log(level, "%s %s -> %d %s: %s", request.method, request.path, status, exc.code, exc.message)
        return web.Response(status=status, body=error_json(exc), content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPMethodNotAllowed):
            # No error code maps to 405: keep the status, give the body OpenAI's shape.
            body = error_body(InvalidRequestError(f"method {request.method} is not allowed on {request.path}"))
            return web.json_response(body, status=405, headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
        err = _http_error(request, exc)
        return web.Response(status=error_status(err), body=error_json(err), content_type="application/json")
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        log.exception("%s %s: internal error", request.method, request.path)
        return web.Response(status=500, body=error_json(exc), content_type="application/json")


def build_app(config: EmulatedNodeConfig) -> web.Application:
    """The node's aiohttp application. Loads the tokenizer and profile now; the engine loop
    starts with the application (it needs the running event loop)."""
    node = EmulatedNode(config, PromptTokenizer.from_dir(config.model_dir), load_profile(config.profile))
    # aiohttp itself refuses larger bodies with 413 before reading them.
    app = web.Application(middlewares=[_errors], client_max_size=config.max_body_bytes)
    app[NODE_KEY] = node

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await node.start()
        yield
        await node.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS_PATH, node.completions)
    app.router.add_post(CHAT_COMPLETIONS_PATH, node.completions)
    app.router.add_get(MODELS_PATH, node.models_list)
    app.router.add_get(HEALTH_PATH, node.health)
    app.router.add_get("/version", node.version)
    app.router.add_post(c.TOKENIZE_PATH, node.tokenize)
    app.router.add_post("/detokenize", node.detokenize)
    app.router.add_get("/metrics", node.metrics_text)
    app.router.add_get(c.STATE_PATH, node.state)
    app.router.add_get(c.STEPS_PATH, node.steps)
    app.router.add_post(KV_PULL_PATH, node.kv_pull)
    return app
