"""Hop 2, to the local vLLM: its body for each route (the chunk schedule, the step budget, the TPOT
SLO), and the relay of its answer, JSON whole or a stream chunk by chunk (the hot path)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.contracts.routes import Route
from kairos.common.errors import InvalidRequestError, KairosError
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError, error_body
from kairos.nodeagent.http1 import ConnectFailed, Http1Error, Response
from kairos.nodeagent.sidecar.hop1 import ERROR_SNIPPET, bad_routing
from kairos.nodeagent.sidecar.hygiene import RESPONSE_DROP, dumps, named_in_connection
from kairos.nodeagent.sidecar.judgement import CHOICE_KEY, ERROR_EVENT, ROLE_KEY, Timing
from kairos.nodeagent.sidecar.metrics import NOT_STREAMED, UNOBSERVED_ERROR
from kairos.nodeagent.sidecar.state import State, count

log = logging.getLogger(__package__)

_ROUTES = frozenset(Route)  # a routed request's path (every one has a prediction to feed back)
# Bytes of a stream read before its first event is complete, at most, where it is looked at first.
FIRST_EVENT_BYTES = 65_536


class Hop2Refused(Exception):
    """The local vLLM refused hop 2 with an answer its caller takes back (``relay``'s
    ``refused``): nothing of it reached the client."""


def deflect_body(state: State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str) -> dict[str, Any]:
    raw_schedule = headers.get(c.H_CHUNK_SCHEDULE)
    if raw_schedule is None:
        count(state, "2", "bad_routing_headers")
        raise bad_routing(rid, f"{c.H_ROUTE}=deflect without {c.H_CHUNK_SCHEDULE}")
    raw_budget = headers.get(c.H_STEP_BUDGET_MS)
    try:
        schedule = c.parse_chunk_schedule_header(raw_schedule)
        budget_ms = None if raw_budget is None else c.parse_step_budget_ms(raw_budget)
    except c.MalformedSchedule as exc:
        count(state, "2", "bad_routing_headers")
        raise bad_routing(rid, str(exc)) from None
    return scheduled_body(body, schedule, budget_ms)


def scheduled_body(body: dict[str, Any], schedule: Sequence[int], budget_ms: float | None) -> dict[str, Any]:
    """The client's own xargs (kairos_* already scrubbed) and a schedule (and step budget)."""
    xargs = body.get(c.VLLM_XARGS)
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidRequestError(f"{c.VLLM_XARGS} must be an object, got {type(xargs).__name__}")
    return {**body, c.VLLM_XARGS: {**(xargs or {}), **c.schedule_xargs(schedule, budget_ms)}}


def with_tpot_slo(state: State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str) -> dict[str, Any]:
    """``body`` for the local vLLM with the TPOT SLO the dispatcher decided the request by
    (:data:`~kairos.common.contracts.H_DECIDED_TPOT_SLO_MS`) in its ``vllm_xargs``: the node's
    step guard holds chunks to its running decodes' tightest TPOT, and its heartbeat reports the
    tightest in flight. Without the header (an older dispatcher) the node counts the cluster's."""
    raw = headers.get(c.H_DECIDED_TPOT_SLO_MS)
    if raw is None:
        return body
    try:
        tpot_ms = c.parse_tpot_slo_ms(raw)
    except c.MalformedSchedule as exc:
        count(state, "2", "bad_routing_headers")
        raise bad_routing(rid, str(exc)) from None
    xargs = body.get(c.VLLM_XARGS)
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidRequestError(f"{c.VLLM_XARGS} must be an object, got {type(xargs).__name__}")
    return {**body, c.VLLM_XARGS: {**(xargs or {}), c.XARG_TPOT_SLO_MS: tpot_ms}}


def local_prefill_body(state: State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str) -> dict[str, Any]:
    """A keep whose prefill node failed it, prefilled on the local vLLM: under the step budget the
    dispatcher sent with the keep, so that the node's guard holds every step that carries its
    chunks within it, as a deflection's (a one-size schedule of the whole prompt: the guard
    shrinks each chunk to what fits beside the decodes, the engine caps it at its step tokens).
    With no budget (an older dispatcher, or the node step guard off), vLLM's own chunking."""
    raw_budget = headers.get(c.H_STEP_BUDGET_MS)
    if raw_budget is None:
        return body
    try:
        budget_ms = c.parse_step_budget_ms(raw_budget)
    except c.MalformedSchedule as exc:
        count(state, "2", "bad_routing_headers")
        raise bad_routing(rid, str(exc)) from None
    raw_tokens = headers.get(c.H_PROMPT_TOKENS, "")
    whole = int(raw_tokens) if raw_tokens.isdecimal() and int(raw_tokens) > 0 else defaults.MAX_MODEL_LEN
    return scheduled_body(body, (whole,), budget_ms)


async def relay(
    request: web.Request,
    state: State,
    data: bytes | None,
    headers: CIMultiDict[str],
    rid: str,
    timing: Timing | None,
    refused: Callable[[int, bytes], bool] | None = None,
) -> web.StreamResponse:
    """Send the request to the local vLLM and relay its answer: JSON whole, anything else (SSE)
    chunk by chunk as it arrives. 5xx and connection failures become our 502/504. With
    ``refused``, the answer's status and body (a stream's: its first event, read before its
    headers go to the client) are shown to it first: :class:`Hop2Refused` when it says so."""
    cfg = state.config
    target = request.raw_path if request.raw_path.startswith("/") else request.rel_url.raw_path_qs
    t = cfg.hop2_timeout_s
    started = time.perf_counter()
    try:
        async with asyncio.timeout(t):  # connect and the response's head; the body's silences are read's
            resp = await state.local.open(request.method, cfg.local_vllm, target, data, headers.items())
    except TimeoutError:
        count(state, "2", "timeout")
        log.warning("request %s: the local vLLM %s gave no answer in %gs", rid, cfg.local_vllm, t)
        raise UpstreamTimeoutError(f"the local vLLM did not answer within {t:g}s") from None
    except (Http1Error, OSError) as exc:
        count(state, "2", "connect" if isinstance(exc, ConnectFailed) else "connection")
        log.warning("request %s: the local vLLM %s failed: %r", rid, cfg.local_vllm, exc)
        raise UpstreamError(f"the local vLLM failed: {type(exc).__name__}") from None

    try:
        head = resp.head
        if head.status >= 500:
            count(state, "2", "status_5xx")
            snippet = await _snippet(resp, t)
            log.warning("request %s: the local vLLM answered %d: %s", rid, head.status, snippet)
            raise UpstreamError(f"the local vLLM answered {head.status}: {snippet}")
        ok = head.status < 400
        dropped = RESPONSE_DROP | named_in_connection(head.headers.get("connection", ""))
        out_headers = CIMultiDict((k, v) for k, v in head.raw_headers if k.lower() not in dropped)
        out_headers.setdefault(c.H_REQUEST_ID, rid)
        for name in c.ECHOED_RESPONSE_HEADERS:  # the dispatcher's decision, for the client to see
            if name in request.headers:
                out_headers[name] = request.headers[name]

        if head.content_type == "application/json" or request.method == "HEAD":
            # Small and complete by nature: relay as one response with its Content-Length.
            parts = []
            try:
                while chunk := await resp.read(t):
                    parts.append(chunk)
            except TimeoutError:
                count(state, "2", "timeout")
                raise UpstreamTimeoutError(f"the local vLLM stalled for {t:g}s mid-response") from None
            except Http1Error as exc:
                count(state, "2", "broken")
                raise UpstreamError(f"the local vLLM broke off its response: {type(exc).__name__}") from None
            whole = b"".join(parts)
            if refused is not None and refused(head.status, whole):
                raise Hop2Refused(f"the local vLLM answered {head.status}")
            if timing is not None:
                # A completion's body is written after its last token: its first byte is no TTFT
                # (the module docstring says why the sidecar does not rebuild it from a stream).
                timing.unobserved = NOT_STREAMED if ok else UNOBSERVED_ERROR
            return web.Response(status=head.status, body=whole, headers=out_headers)

        feedback = state.feedback

        def first_event(chunk: bytes) -> None:
            """The stream's first bytes: its first token, unless the node answered an error."""
            if timing is None:
                return
            if not ok or ERROR_EVENT.match(chunk):
                timing.unobserved = UNOBSERVED_ERROR
                return
            now = time.perf_counter()
            timing.ttfb_s = now - started
            timing.ttft_s = now - timing.started
            if feedback and timing.predicted_s and timing.path in _ROUTES:
                # Queued now; the writer runs at its next wait, after this chunk is written.
                feedback.offer(rid, timing.path, timing.node, timing.predicted_s, timing.ttft_s)

        ahead = b""
        if refused is not None:
            ahead = await _first_event(state, resp, t)
            if refused(head.status, ahead):
                raise Hop2Refused(f"the local vLLM answered {head.status} with an error event")
        return await _stream(request, state, resp, out_headers, first_event, rid, timing, ahead)
    finally:
        resp.close()  # before the body's end this drops the connection, so vLLM aborts the request


async def _stream(
    request: web.Request,
    state: State,
    resp: Response,
    out_headers: CIMultiDict[str],
    first_event: Callable[[bytes], None],
    rid: str,
    timing: Timing | None = None,
    read_ahead: bytes = b"",
) -> web.StreamResponse:
    """Relay a streaming body (SSE) chunk by chunk (``read_ahead``: its start, read already):
    each chunk is written to the client's socket as soon as it arrives (aiohttp writes straight
    to the transport; TCP_NODELAY is on). For a
    request judged against its SLOs, the arrival of each chunk after the first that carries a
    token, and the token events, for :func:`slo_outcome` at the end. A chunk is what one read
    returns: an SSE event, or a few that arrived together (coalesced in the socket while the
    previous write was out); a gap is measured between chunks, so coalesced tokens count as one
    gap, and the first chunk's arrival is the TTFT."""
    t = state.config.hop2_timeout_s
    out = web.StreamResponse(status=resp.status, headers=out_headers)
    await out.prepare(request)  # headers go out now: the client sees the stream open at once
    first = True
    last = previous = b""
    failure: KairosError | None = None
    judged = timing is not None and timing.slo_class is not None
    arrivals: list[float] = timing.arrivals if timing is not None else []
    clock = time.perf_counter
    events = 0
    try:
        while chunk := read_ahead or await resp.read(t):
            read_ahead = b""
            if first:
                first_event(chunk)
                first = False
                events = chunk.count(CHOICE_KEY) - chunk.count(ROLE_KEY)
            elif judged and (n := chunk.count(CHOICE_KEY)):  # the hot path: a count, a clock read, an append
                arrivals.append(clock())
                events += n
            await out.write(chunk)
            previous, last = last, chunk
    except ConnectionResetError:
        # The client went away (aiohttp's ClientConnectionResetError also lands here). Leaving
        # lets relay close the upstream connection, which makes vLLM abort the generation.
        log.info("request %s: the client disconnected mid-stream; aborting the upstream request", rid)
        return out
    except TimeoutError:
        count(state, "2", "timeout")
        failure = UpstreamTimeoutError(f"the local vLLM stalled for {t:g}s mid-stream")
    except Http1Error as exc:
        count(state, "2", "broken")
        failure = UpstreamError(f"the local vLLM broke off the stream: {type(exc).__name__}")
    if timing is not None:
        timing.token_events = events
        timing.stream_tail = previous + last
        timing.stream_end = "complete" if failure is None else "failed"
    if failure is not None:
        log.warning("request %s: %s", rid, failure.message)
        if resp.head.content_type == "text/event-stream":
            # The status is already sent: say it in the stream, as vLLM does for its own errors
            # (the openai SDK raises APIError on a data event carrying "error"). No [DONE].
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"
            with contextlib.suppress(ConnectionResetError):
                await out.write(sep + b"data: " + dumps(error_body(failure)) + b"\n\n")
        else:
            # No way to signal it in-band: cut the connection so the body reads as truncated.
            if request.transport is not None:
                request.transport.close()
            return out
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()
    return out


async def _first_event(state: State, resp: Response, timeout_s: float) -> bytes:
    """A stream's start up to its first whole event (or its end, or FIRST_EVENT_BYTES), before
    anything of it is relayed: 504/502 as a stall or a break before the response's head."""
    raw = b""
    try:
        while b"\n\n" not in raw and len(raw) < FIRST_EVENT_BYTES and (chunk := await resp.read(timeout_s)):
            raw += chunk
    except TimeoutError:
        count(state, "2", "timeout")
        raise UpstreamTimeoutError(f"the local vLLM sent no event within {timeout_s:g}s") from None
    except Http1Error as exc:
        count(state, "2", "broken")
        raise UpstreamError(f"the local vLLM broke off its stream: {type(exc).__name__}") from None
    return raw


async def _snippet(resp: Response, timeout_s: float) -> str:
    """The start of an error reply's body, for our own error message."""
    raw = b""
    try:
        while len(raw) < ERROR_SNIPPET and (chunk := await resp.read(timeout_s)):
            raw += chunk
    except (Http1Error, TimeoutError):
        if not raw:
            return "(no body)"
    return raw[:ERROR_SNIPPET].decode("utf-8", "replace")
