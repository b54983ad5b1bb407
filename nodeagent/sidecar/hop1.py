"""Hop 1 of a keep or a split: the prefill host the dispatcher named, checked against the allowlists,
and the prefill there (``max_tokens=1``, ``do_remote_decode``), which answers with
``kv_transfer_params``: a keep's of the client's whole prompt, a split's of its first k tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from kairos.common import contracts as c
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError
from kairos.nodeagent.http1 import ConnectFailed, Http1Error
from kairos.nodeagent.sidecar.config import normalize_hostport
from kairos.nodeagent.sidecar.hygiene import dumps, loads
from kairos.nodeagent.sidecar.judgement import Timing
from kairos.nodeagent.sidecar.state import State, count

log = logging.getLogger(__package__)

# What hop 1 asks of the prefill node (vLLM's NixlConnector convention): keep the KV blocks for
# a remote decoder to pull, and say where they are in the reply's kv_transfer_params.
HOP1_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


ERROR_SNIPPET = 300  # characters of an upstream error body quoted in our own error message


class _PrefillHostNotAllowedError(UpstreamError):
    """The routing header named a prefill host that is on no allowlist (answered 502)."""


def bad_routing(rid: str, detail: str) -> UpstreamError:
    # The routing headers come from our own dispatcher, so a bad one is a gateway fault (502),
    # never the client's (400).
    log.error("request %s: bad routing headers from the dispatcher: %s", rid, detail)
    return UpstreamError(f"bad routing headers: {detail}")


def checked_prefill_host(state: State, headers: CIMultiDictProxy[str], rid: str) -> str:
    value = headers.get(c.H_PREFILL_HOST)
    if value is None:
        count(state, "1", "bad_routing_headers")
        raise bad_routing(rid, f"{c.H_ROUTE}={headers.get(c.H_ROUTE, '')} without {c.H_PREFILL_HOST}")
    host = normalize_hostport(value)
    if host is None:
        count(state, "1", "bad_routing_headers")
        raise bad_routing(rid, f"{c.H_PREFILL_HOST}={value!r} is not host:port")
    if host in state.config.allowed_prefill_hosts:
        return host
    live: Collection[str] = ()
    if state.allowlist is not None:
        try:
            live = state.allowlist()
        except Exception as exc:  # the live view failing must not take the static allowlist down too
            log.warning("request %s: the live prefill allowlist failed (%s); using the static one", rid, exc)
    if host in {normalize_hostport(h) for h in live}:
        return host
    count(state, "1", "not_allowed")
    log.warning(
        "request %s: refused to call prefill host %s: it is neither in allowed_prefill_hosts %s nor in the "
        "live cluster view",
        rid,
        host,
        list(state.config.allowed_prefill_hosts),
    )
    raise _PrefillHostNotAllowedError(f"prefill host {host} is not on this sidecar's allowlist")


def keep_hop1_body(body: dict[str, Any]) -> dict[str, Any]:
    """A keep's hop 1: the client's body, the prefill of its whole prompt and nothing more."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    # One prefill whatever the client's n (the gateway fans n > 1 out, one request per choice;
    # this holds for a keep routed here by hand). With n > 1 vLLM runs n child requests: on a
    # prefill node each would hold its own copy of the KV while the reply names one child's (the
    # last to finish); the rest stay pinned until NixlConnector's lease (kv_lease_duration, 30 s).
    if "n" in out:
        out["n"] = 1
    # min_tokens > 1 would make vLLM reject max_tokens=1 (a 400 that is not the client's fault).
    out.pop("min_tokens", None)
    out[c.KV_TRANSFER_PARAMS] = dict(HOP1_KV_TRANSFER_PARAMS)
    return out


async def hop1(
    state: State,
    api_path: str,
    prefill_host: str,
    hop_body: dict[str, Any],
    headers: CIMultiDict[str],
    rid: str,
    timing: Timing,
) -> dict[str, Any] | web.Response:
    """Prefill ``hop_body`` (:func:`keep_hop1_body`, or a split's) on ``prefill_host``: its
    ``kv_transfer_params``, or the response to relay (4xx). :class:`UpstreamError` when the
    prefill node failed it (dead, reset, 5xx, no answer in time, no params)."""
    cfg = state.config
    assert state.hop1_client is not None, "the client is created on app startup"
    hop_headers = CIMultiDict(headers)
    hop_headers[hdrs.CONTENT_TYPE] = "application/json"
    hop_headers[hdrs.ACCEPT_ENCODING] = "identity"  # we parse this reply
    started = time.perf_counter()
    # The deadline bounds the whole hop (a prefill that accepts and then hangs included); the
    # client's connect timeout fails fast on an unreachable host.
    deadline = asyncio.timeout(cfg.hop1_timeout_s)
    try:
        async with deadline:
            reply = await state.hop1_client.request(
                "POST", prefill_host, api_path, dumps(hop_body), hop_headers.items()
            )
    except TimeoutError:
        count(state, "1", "timeout")
        elapsed = time.perf_counter() - started
        # The connect timeout is a TimeoutError too: say which bound ran out.
        what = "gave no answer" if deadline.expired() else "could not be connected to"
        log.warning("request %s: prefill node %s %s in %.2fs", rid, prefill_host, what, elapsed)
        raise UpstreamTimeoutError(f"prefill node {prefill_host} {what} within {elapsed:.1f}s") from None
    except ConnectFailed as exc:
        count(state, "1", "connect")
        log.warning("request %s: cannot connect to prefill node %s: %s", rid, prefill_host, exc.os_error)
        raise UpstreamError(f"cannot connect to prefill node {prefill_host}: {exc.os_error}") from None
    except (Http1Error, OSError) as exc:
        count(state, "1", "connection")
        log.warning("request %s: prefill node %s: connection failed: %r", rid, prefill_host, exc)
        raise UpstreamError(f"prefill node {prefill_host}: connection failed ({type(exc).__name__})") from None
    raw, status = reply.body, reply.status
    content_type = reply.headers.get("content-type", "application/json")
    elapsed = time.perf_counter() - started
    if 400 <= status < 500:
        # The prefill vLLM validated the client's own request (prompt too long, bad parameter):
        # its answer is the client's to see, as it would be without disaggregation.
        count(state, "1", "status_4xx")
        log.info("request %s: prefill node %s answered %d; relayed to the client", rid, prefill_host, status)
        return web.Response(status=status, body=raw, headers={hdrs.CONTENT_TYPE: content_type, c.H_REQUEST_ID: rid})
    if status >= 300:
        count(state, "1", f"status_{status // 100}xx")
        snippet = raw[:ERROR_SNIPPET].decode("utf-8", "replace")
        log.warning("request %s: prefill node %s answered %d: %s", rid, prefill_host, status, snippet)
        raise UpstreamError(f"prefill node {prefill_host} answered {status}: {snippet}")
    try:
        reply = loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        reply = None
    params = reply.get(c.KV_TRANSFER_PARAMS) if isinstance(reply, dict) else None
    if not isinstance(params, dict):
        count(state, "1", "no_kv_transfer_params")
        log.error(
            "request %s: prefill node %s replied without %s: is its vLLM running with a KV connector "
            "(kv_producer or kv_both)?",
            rid,
            prefill_host,
            c.KV_TRANSFER_PARAMS,
        )
        raise UpstreamError(f"prefill node {prefill_host} returned no {c.KV_TRANSFER_PARAMS}")
    timing.hop1_s = elapsed
    return params
