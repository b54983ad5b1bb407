"""The sidecar's aiohttp app: its routes, the completion handler that carries out the dispatcher's
decision, the pass-through of the public API, health, and each request's metrics at its end."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

from aiohttp import hdrs, web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kairos.common import contracts as c
from kairos.common.contracts.api import COMPLETIONS_PATH, HEALTH_PATH, INFERENCE_PATHS
from kairos.common.contracts.routes import Route
from kairos.common.errors import KairosError, MethodNotAllowedError, NotFoundError
from kairos.common.http_errors import UpstreamError, error_json, error_status
from kairos.nodeagent import fanout
from kairos.nodeagent.http1 import Http1Client, Http1Error
from kairos.nodeagent.sidecar.config import SidecarConfig
from kairos.nodeagent.sidecar.feedback import (
    FEEDBACK_QUEUE,
    FEEDBACK_RETRY_S,
    FEEDBACK_TIMEOUT_S,
    TtftFeedbackPublisher,
)
from kairos.nodeagent.sidecar.hop1 import bad_routing, checked_prefill_host, hop1, keep_hop1_body
from kairos.nodeagent.sidecar.hop2 import Hop2Refused, deflect_body, local_prefill_body, relay, with_tpot_slo
from kairos.nodeagent.sidecar.hygiene import (
    check_identity_encoding,
    dumps,
    forward_headers,
    parse_object,
    read_body,
    scrub_client_fields,
)
from kairos.nodeagent.sidecar.judgement import Timing, judged_by, slo_outcome
from kairos.nodeagent.sidecar.metrics import (
    ABORTED,
    PATH_LOCAL,
    PATHS,
    SPLIT_NO_CONNECTOR,
    UNOBSERVED_ERROR,
    SidecarMetrics,
)
from kairos.nodeagent.sidecar.split import (
    SplitDegraded,
    checked_split_params,
    checked_split_route,
    is_split_refused,
    prompt_token_ids,
    split_decode_body,
    split_hop1_body,
)
from kairos.nodeagent.sidecar.state import METRICS, STATE, State, count

log = logging.getLogger(__package__)

_HEALTH_TIMEOUT_S = 2.0  # the local vLLM's /health answers at once when it is up
# After the local vLLM refuses a split's decode hop (it does not load Kairos's split connector),
# splits are served as keeps without trying for this long: each refused split leaves its first k
# tokens' KV held on its prefill node until its NixlConnector lease runs out (kv_lease_duration,
# 30 s by default in vLLM 0.32). A vLLM restarted with the connector takes splits again within this time.
SPLIT_REFUSED_RETRY_S = 60.0


# The dispatcher's TTFT prediction for each route: the keep path's, or the decode node's (a
# deflection's, or a split's, planned on that node).
_PREDICTION_HEADER = {
    Route.KEEP: c.H_PRED_TTFT_PREFILL_MS,
    Route.DEFLECT: c.H_PRED_TTFT_DECODE_MS,
    Route.SPLIT: c.H_PRED_TTFT_DECODE_MS,
}


def _predicted_ttft_s(headers: Mapping[str, str], route: str | None) -> float | None:
    name = _PREDICTION_HEADER.get((route or "").strip().lower())
    try:
        return float(headers[name]) / 1e3 if name and name in headers else None
    except ValueError:
        return None


def build_app(config: SidecarConfig, allowlist: Callable[[], Collection[str]] | None = None) -> web.Application:
    """The sidecar's aiohttp app. ``allowlist`` returns the prefill hosts (host:port) the live
    cluster view knows; a prefill host is allowed if it is in ``config.allowed_prefill_hosts``
    or in that callable's current result."""
    # Bodies are read by read_body with our own bound; this is only aiohttp's backstop.
    # auto_decompress off: a compressed body is refused (415) by the handler; aiohttp would
    # inflate it unbounded, or drop the connection on a body that is not what its label says.
    app = web.Application(client_max_size=config.max_body_bytes + 1, handler_args={"auto_decompress": False})
    classes = config.slo_classes
    state = State(config=config, allowlist=allowlist, metrics=SidecarMetrics(classes), classes=classes)
    app[STATE] = state
    app[METRICS] = state.metrics

    async def clients(app: web.Application) -> AsyncIterator[None]:
        # No connection limit: vLLM bounds its own concurrency, and a stream holds its connection
        # for the whole generation. Bodies are relayed byte for byte, Content-Encoding included.
        state.hop1_client = Http1Client(config.hop1_connect_timeout_s)
        state.local_client = Http1Client(config.hop2_timeout_s)
        yield
        await state.hop1_client.close()
        await state.local_client.close()

    app.cleanup_ctx.append(clients)
    if config.redis_url:

        async def feedback(app: web.Application) -> AsyncIterator[None]:
            state.feedback = TtftFeedbackPublisher(
                config.redis_url,
                state.metrics,
                queue_size=FEEDBACK_QUEUE,
                timeout_s=FEEDBACK_TIMEOUT_S,
                retry_s=FEEDBACK_RETRY_S,
            )
            await state.feedback.start()
            yield
            await state.feedback.stop()

        app.cleanup_ctx.append(feedback)
    for path in INFERENCE_PATHS:
        app.router.add_post(path, _completion)
    app.router.add_get(c.SIDECAR_METRICS_PATH, _metrics)
    app.router.add_get(c.SIDECAR_PROBE_PATH, _probe)
    app.router.add_get(HEALTH_PATH, _health)
    # Of the local vLLM, only the public API is relayed: its /metrics, /kairos/state, step log
    # and KV endpoints are served on the node's own port, never through this one.
    for path, methods in c.PUBLIC_ENDPOINTS.items():
        if path not in INFERENCE_PATHS and path != HEALTH_PATH:
            for method in methods:
                app.router.add_route(method, path, _pass_through)
    app.router.add_route("*", "/{tail:.*}", _not_public)
    return app


async def _completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    rid = request.headers.get(c.H_REQUEST_ID) or uuid.uuid4().hex
    route = request.headers.get(c.H_ROUTE)
    timing = Timing(PATH_LOCAL if route is None else route.strip().lower())
    timing.predicted_s = _predicted_ttft_s(request.headers, route)
    timing.node = request.headers.get(c.H_DECODE_NODE) or state.config.local_vllm
    timing.slo_class, timing.slo = judged_by(request.headers, state.classes)
    status = 0
    try:
        check_identity_encoding(request.headers)
        raw = await read_body(request, state.config.max_body_bytes)
        body = parse_object(raw)
        scrubbed = scrub_client_fields(body, rid)
        clean = body if scrubbed is None else scrubbed
        headers = forward_headers(request.headers, rid)
        split_hop = False  # hop 2 is a split's decode hop, which the local vLLM may refuse
        if timing.path == c.ROUTE_FANOUT:  # a batch: each prompt back through the gateway
            timing.slo_class = None  # each prompt is judged where it is served
            cfg, client = state.config, state.hop1_client  # hop 1's client: the short connect timeout
            assert client is not None, "the client is created on app startup"
            return await fanout.serve(request, cfg.gateway, client, clean, headers, rid, cfg.hop2_timeout_s)
        if route is None:
            if not state.logged_unrouted:
                state.logged_unrouted = True
                log.info(
                    "request %s has no %s header (it did not come through the gateway): serving it on "
                    "the local vLLM as plain aggregated serving; logged once",
                    rid,
                    c.H_ROUTE,
                )
            data = raw if scrubbed is None else dumps(scrubbed)
        elif timing.path in (Route.KEEP, Route.SPLIT):
            prefilled = await _prefill_hops(request, state, clean, headers, rid, timing)
            if isinstance(prefilled, web.Response):
                status = prefilled.status
                return prefilled
            hop2_body, split_hop = prefilled
            data = dumps(with_tpot_slo(state, hop2_body, request.headers, rid))
        elif timing.path == Route.DEFLECT:
            deflected = deflect_body(state, clean, request.headers, rid)
            data = dumps(with_tpot_slo(state, deflected, request.headers, rid))
        else:
            count(state, "2", "bad_routing_headers")
            routes = ", ".join(repr(r.value) for r in Route)
            raise bad_routing(rid, f"{c.H_ROUTE}={route!r} is none of {routes}")
        if data is not raw:
            headers[hdrs.CONTENT_TYPE] = "application/json"  # we wrote this body
        try:
            response = await relay(request, state, data, headers, rid, timing, is_split_refused if split_hop else None)
        except Hop2Refused:  # nothing of it reached the client
            kept = await _split_refused_as_keep(request, state, clean, headers, rid, timing)
            if isinstance(kept, web.Response):
                status = kept.status
                return kept
            data = dumps(with_tpot_slo(state, kept, request.headers, rid))
            response = await relay(request, state, data, headers, rid, timing)
        status = response.status
        return response
    except KairosError as exc:
        status = error_status(exc)
        return _error_response(exc, rid)
    except Exception as exc:
        # A bug of ours: a JSON 500 with a generic message (http_errors), the traceback in the log.
        log.exception("request %s: internal error", rid)
        status = error_status(exc)
        return _error_response(exc, rid)
    finally:
        _observe(state, timing, rid, status)


async def _prefill_hops(
    request: web.Request, state: State, clean: dict[str, Any], headers: CIMultiDict[str], rid: str, timing: Timing
) -> tuple[dict[str, Any], bool] | web.Response:
    """A keep's or a split's hop 1 on the prefill node: hop 2's body for the local vLLM and whether
    it is a split's decode hop, or the prefill node's answer to relay (4xx). A split whose prompt
    this node counts otherwise than the dispatcher is served as a keep (``timing`` then says keep,
    with the keep's prediction)."""
    prefill_host = checked_prefill_host(state, request.headers, rid)
    split = checked_split_route(state, request.headers, rid) if timing.path == Route.SPLIT else None
    ids: list[int] = []
    if split is not None and time.monotonic() < state.splits_refused_until:
        _served_as_keep(request, state, timing, SPLIT_NO_CONNECTOR)  # its vLLM refused the last split
        split = None
    if split is not None:
        try:
            ids = await prompt_token_ids(state, request.path, clean, headers, split)
        except SplitDegraded as exc:
            log.warning("request %s: not split (%s): %s; served as a keep", rid, exc.reason, exc.detail)
            _served_as_keep(request, state, timing, exc.reason)
            split = None
    if split is None:
        kept = await _keep_hop1(request, state, clean, headers, rid, timing, prefill_host)
        return kept if isinstance(kept, web.Response) else (kept, False)
    # A completions prompt of token ids, whatever the client's endpoint.
    hop_body = split_hop1_body(clean, ids[: split.split_tokens])
    try:
        prefilled = await hop1(state, COMPLETIONS_PATH, prefill_host, hop_body, headers, rid, timing)
        if not isinstance(prefilled, web.Response):
            checked_split_params(state, prefilled, split, prefill_host)
    except UpstreamError as exc:
        return _local_prefill(request, state, clean, rid, exc), False
    if isinstance(prefilled, web.Response):
        return prefilled
    return split_decode_body(clean, prefilled, split), True


async def _keep_hop1(
    request: web.Request,
    state: State,
    clean: dict[str, Any],
    headers: CIMultiDict[str],
    rid: str,
    timing: Timing,
    prefill_host: str,
) -> dict[str, Any] | web.Response:
    """A keep's hop 1, the client's whole prompt on the prefill node: hop 2's body, or the prefill
    node's answer to relay (4xx)."""
    try:
        prefilled = await hop1(state, request.path, prefill_host, keep_hop1_body(clean), headers, rid, timing)
    except UpstreamError as exc:
        return _local_prefill(request, state, clean, rid, exc)
    if isinstance(prefilled, web.Response):
        return prefilled
    return {**clean, c.KV_TRANSFER_PARAMS: prefilled}


def _local_prefill(
    request: web.Request, state: State, clean: dict[str, Any], rid: str, exc: UpstreamError
) -> dict[str, Any]:
    """The prefill node failed hop 1 before a byte reached the client (dead, reset, 5xx, no answer
    in time): the local vLLM prefills the whole prompt, as it would with no prefill pool. Envoy's
    retry could only reach another decode node whose hop 1 calls the same prefill node."""
    log.warning("request %s: %s; prefilling it on the local vLLM instead", rid, exc.message)
    state.metrics.local_prefills.inc()
    return local_prefill_body(state, clean, request.headers, rid)


async def _split_refused_as_keep(
    request: web.Request, state: State, clean: dict[str, Any], headers: CIMultiDict[str], rid: str, timing: Timing
) -> dict[str, Any] | web.Response:
    """The local vLLM refused the split's decode hop (the validator plugin's 400: its KV connector
    is not Kairos's split connector, on which the hop would have failed its engine), before any
    byte reached the client: the request is served as a keep, its whole prompt through hop 1 on
    the same prefill node (which caches the split's first k tokens by now). Logged once, counted;
    the splits of the next SPLIT_REFUSED_RETRY_S are served as keeps at once."""
    state.splits_refused_until = time.monotonic() + SPLIT_REFUSED_RETRY_S
    if not state.logged_split_refused:
        state.logged_split_refused = True
        log.warning(
            "request %s: the local vLLM %s refused a split's decode hop: it does not load Kairos's split connector "
            "(--kv-transfer-config's kv_connector_module_path); splits sent here are served as keeps, counted in "
            "kairos_sidecar_split_degraded_total{reason=%r}, and tried again every %gs; logged once",
            rid,
            state.config.local_vllm,
            SPLIT_NO_CONNECTOR,
            SPLIT_REFUSED_RETRY_S,
        )
    _served_as_keep(request, state, timing, SPLIT_NO_CONNECTOR)
    prefill_host = checked_prefill_host(state, request.headers, rid)  # checked before the split's hop 1
    return await _keep_hop1(request, state, clean, headers, rid, timing, prefill_host)


def _served_as_keep(request: web.Request, state: State, timing: Timing, reason: str) -> None:
    """A split served as a keep: counted by ``reason``, and timed as the keep it is."""
    state.metrics.split_degraded.labels(reason).inc()
    timing.path = Route.KEEP
    timing.predicted_s = _predicted_ttft_s(request.headers, Route.KEEP)


async def _pass_through(request: web.Request) -> web.StreamResponse:
    """Everything but the completion routes (``/v1/models``, ``/metrics``, ``/tokenize``, ...):
    the local vLLM's answer, unchanged."""
    state = request.app[STATE]
    rid = request.headers.get(c.H_REQUEST_ID) or uuid.uuid4().hex
    try:
        check_identity_encoding(request.headers)
        data = await read_body(request, state.config.max_body_bytes) if request.body_exists else None
        return await relay(request, state, data, forward_headers(request.headers, rid), rid, None)
    except KairosError as exc:
        return _error_response(exc, rid)
    except Exception as exc:
        log.exception("request %s: internal error", rid)
        return _error_response(exc, rid)


async def _not_public(request: web.Request) -> web.Response:
    rid = request.headers.get(c.H_REQUEST_ID) or uuid.uuid4().hex
    methods = c.PUBLIC_ENDPOINTS.get(request.path)
    if methods is not None:
        return _error_response(MethodNotAllowedError(f"{request.method} is not allowed on {request.path}"), rid)
    return _error_response(NotFoundError(f"{request.path} is not served by this sidecar"), rid)


async def _health(request: web.Request) -> web.Response:
    """200 when the local vLLM's /health answers 200, else 503 (Envoy's health check)."""
    state = request.app[STATE]
    try:
        async with asyncio.timeout(_HEALTH_TIMEOUT_S):
            reply = await state.local.request("GET", state.config.local_vllm, HEALTH_PATH, None, ())
        if reply.status == 200:
            return web.json_response({"status": "ok", "local_vllm": state.config.local_vllm})
        detail = f"local vLLM /health answered {reply.status}"
    except TimeoutError:
        detail = f"local vLLM /health did not answer within {_HEALTH_TIMEOUT_S:g}s"
    except (Http1Error, OSError) as exc:
        detail = f"local vLLM unreachable: {exc}"
    log.warning("health check failed: %s", detail)
    return web.json_response(
        {"status": "unhealthy", "local_vllm": state.config.local_vllm, "detail": detail}, status=503
    )


async def _probe(request: web.Request) -> web.Response:
    """The node agent's liveness probe (``kairos.nodeagent.heartbeat.SidecarProbe``): answered by
    this event loop alone, so it fails only when the sidecar does."""
    return web.Response(status=204)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})


def _error_response(exc: BaseException, rid: str) -> web.Response:
    return web.Response(
        status=error_status(exc),
        body=error_json(exc),
        headers={hdrs.CONTENT_TYPE: "application/json", c.H_REQUEST_ID: rid},
    )


def _observe(state: State, timing: Timing, rid: str, status: int) -> None:
    m = state.metrics
    path = timing.path if timing.path in PATHS else PATH_LOCAL
    if timing.hop1_s is not None and (hop1_seconds := m.hop1.get(path)) is not None:
        hop1_seconds.observe(timing.hop1_s)
    if timing.ttfb_s is not None:
        m.ttfb[path].observe(timing.ttfb_s)
    if timing.ttft_s is not None:
        m.ttft[path].observe(timing.ttft_s)
        ratio = m.ttft_ratio.get(path)  # a prediction comes with a route only
        if timing.predicted_s and ratio is not None:
            ratio.observe(timing.ttft_s / timing.predicted_s)
    else:
        # No status: the handler never returned a response (cancelled: its client left).
        reason = timing.unobserved or (UNOBSERVED_ERROR if status else ABORTED)
        m.unobserved[path, reason].inc()
    if timing.slo_class is not None:
        outcome, tokens = slo_outcome(timing)
        m.slo_requests[timing.slo_class, outcome].inc()
        if tokens:
            m.slo_goodput_tokens[timing.slo_class].inc(tokens)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "request %s: path=%s status=%d hop1=%s ttfb=%s ttft=%s total=%s",
            rid,
            timing.path,
            status,
            _ms(timing.hop1_s),
            _ms(timing.ttfb_s),
            _ms(timing.ttft_s),
            _ms(time.perf_counter() - timing.started),
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"
