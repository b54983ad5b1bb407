"""The decode-node sidecar: carries out the dispatcher's decision beside one decode node's vLLM.

Envoy sends every request for this decode node here, with the decision in ``x-kairos-*`` headers:

  keep     hop 1: the prefill node's vLLM runs the prompt with ``max_tokens=1`` and
           ``do_remote_decode`` and answers with ``kv_transfer_params``; hop 2: the local vLLM
           gets the client's original body plus those params and pulls the KV (NixlConnector).
           This is the two-hop protocol of vLLM's ``toy_proxy_server.py`` and llm-d's sidecar.
  deflect  one hop to the local vLLM, the chunk schedule in ``vllm_xargs`` (read by the Kairos
           scheduler plugin).
  Both routes' hop to the local vLLM carries the request's TPOT SLO (``vllm_xargs``
  ``kairos_tpot_slo_ms``, from the dispatcher's ``x-kairos-slo-tpot-ms``); the client's body
  fields, vLLM's ``priority`` included, go to every hop as sent.
  fanout   a batch (several prompts): each prompt is sent back through the gateway (``--gateway``)
           for a decision of its own, and the answers merged as vLLM's (kairos.nodeagent.fanout).
  (none)   the request reached the sidecar directly: plain aggregated serving on the local vLLM.

With a Redis URL (``--redis``), the sidecar also reports each routed request's observed TTFT
beside the dispatcher's prediction: one XADD per request, after its first token, to the capped
stream ``kairos:ttft-feedback``, which the dispatchers read into their live model-error metrics.
It is fire-and-forget: a bounded queue and one writer task, so Redis being slow or gone never
delays or fails a request (samples are dropped and counted instead). Without a URL, no Redis.

TTFT is what the sidecar sees of the first token: the first event of a streamed response, which
vLLM writes once the first token is out (a chat stream's role chunk comes with it). A
non-streamed response is one JSON body that vLLM writes after the last token: its first byte
times the whole generation, so such a request has no TTFT here (no ``kairos_sidecar_ttft_seconds``
sample, no feedback) and is counted in ``kairos_sidecar_ttft_unobserved_total{reason="not_streamed"}``
instead, as are requests with no first token at all (``error``, ``aborted``). The sidecar does not
stream from vLLM and rebuild the JSON body: vLLM's non-streamed body is not its stream put
together (``prompt_logprobs``, ``kv_transfer_params`` and ``service_tier`` are only in the body,
``usage`` is in a stream only when asked for, and each vLLM version adds fields), so a rebuilt
body would in time differ from the one vLLM sends, a wrong answer to the client; and it would
cost a JSON parse per token on the sidecar's one core. A missing sample only makes the live
check smaller: the streamed requests still carry it, and the counter shows the gap.

Each completion is judged against its own SLOs at its stream's end, by the simulator's and
``kairos replay``'s definition (:func:`kairos.core.slo.meets_slo`: TTFT within its TTFT SLO, at
most 5% of its inter-token gaps over its TPOT SLO): ``kairos_sidecar_slo_requests_total{class,
outcome}`` counts it met or missed (a stream that broke off after its first token, or ended in an
error event, missed), or unobserved where nothing can be judged (not streamed, an error before
the first token, the client left), and ``kairos_sidecar_slo_goodput_tokens_total{class}`` adds
the output tokens of those that met theirs. Its SLOs are its own: the client's ``x-slo-*``
headers, else those the dispatcher decided it by, else the cluster's defaults; its class is the
dispatcher's ``x-kairos-slo-class`` where that names one of the sidecar's classes, else the class
its SLOs fall in, so a label never carries what a client sent.

Every other path (``/v1/models``, ``/metrics``, ...) is proxied to the local vLLM unchanged.
Responses stream back unbuffered. The prefill host comes from a header, so the sidecar only
calls hosts on its allowlist (static hosts plus those the live cluster view knows).

Run: ``python -m kairos.nodeagent.sidecar --port 8201 --local-vllm 127.0.0.1:8101 --allow-prefill 127.0.0.1:8001
--gateway 127.0.0.1:8000``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from redis.exceptions import RedisError

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.aio import cancel_and_wait
from kairos.common.contracts.api import HEALTH_PATH, INFERENCE_PATHS
from kairos.common.contracts.routes import Route
from kairos.common.errors import (
    ConfigError,
    InvalidRequestError,
    KairosError,
    MethodNotAllowedError,
    NotFoundError,
    UnsupportedContentEncodingError,
)
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError, error_body, error_json, error_status
from kairos.common.redis_client import check_redis_url, fail_fast_client, redact_url
from kairos.common.runtime import Service, announce_listening, flag_overrides, freeze_startup_heap, serving
from kairos.core.slo import (
    DEFAULT_CLASSES,
    DEFAULT_SLO,
    RequestSLO,
    SloClass,
    classify,
    format_classes,
    meets_slo,
    parse_classes,
    request_slo,
)
from kairos.nodeagent import fanout
from kairos.nodeagent.http1 import ConnectFailed, Http1Client, Http1Error, Response

log = logging.getLogger(__name__)

PATH_LOCAL = "local"  # metrics label of requests served without a routing decision
PATHS = (*Route, PATH_LOCAL)
# Why a completion request has no TTFT sample (kairos_sidecar_ttft_unobserved_total's reasons).
NOT_STREAMED = "not_streamed"  # one JSON body after the last token: no first token to see
UNOBSERVED_ERROR = "error"  # an error status, a failed hop, or an error event first in the stream
ABORTED = "aborted"  # the client left before the first token
UNOBSERVED = (NOT_STREAMED, UNOBSERVED_ERROR, ABORTED)
# An SSE event that carries vLLM's error object ({"error": {...}}) rather than a token.
_ERROR_EVENT = re.compile(rb'data: ?\{\s*"error"')
# A completion's judgement against its SLOs (kairos_sidecar_slo_requests_total's outcomes).
SLO_MET = "met"
SLO_MISSED = "missed"
SLO_UNOBSERVED = "unobserved"  # not streamed, an error before the first token, the client left
SLO_OUTCOMES = (SLO_MET, SLO_MISSED, SLO_UNOBSERVED)
# Every choice event of a completion or chat stream has this key, once per choice; a usage-only
# event and [DONE] have none. A JSON string's quotes are escaped, so no token text matches it.
_CHOICE_KEY = b'"finish_reason"'
_ROLE_KEY = b'"role"'  # a chat stream's role event (one per choice), sent with the first token
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')  # a usage event's

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

# RFC 9110 §7.6.1 hop-by-hop headers, plus those the sidecar sets itself per hop.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect", "accept-encoding", c.H_REQUEST_ID}
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}

# host:port, nothing else; underscores allowed for docker-compose service names.
_HOSTPORT = re.compile(r"(?:\[[0-9a-f:.]+\]|[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?):([0-9]{1,5})")
# TTFT-scale buckets (seconds) around the 4 s TTFT SLO; hop 1 and TTFB share them.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)
_HEALTH_TIMEOUT_S = 2.0  # the local vLLM's /health answers at once when it is up
_SHUTDOWN_GRACE_S = 30.0  # in-flight streams get this long to finish on SIGTERM
# A request line or header may take this much (aiohttp's default: 8190 bytes): Envoy passes heads
# of up to 60 KiB (its max_request_headers_kb default) and vLLM's server reads 4 MiB, so the
# sidecar is never the one to refuse a request, with aiohttp's bare text/plain 400.
_MAX_REQUEST_LINE_BYTES = 64 * 1024
_ERROR_SNIPPET = 300  # characters of an upstream error body quoted in our own error message
# TTFT feedback: samples waiting for the writer (beyond this they are dropped, never waited for),
# the bound on one Redis round trip, and how long to drop samples after a failure before retrying.
_FEEDBACK_QUEUE = 1000
_FEEDBACK_TIMEOUT_S = 0.25
_FEEDBACK_RETRY_S = 1.0
_FEEDBACK_BATCH = 100  # XADDs per pipelined round trip when samples queue up
# How long the writer lets samples gather after the first one before it sends them (unless a full
# batch is waiting): one round trip per 200 ms at most, not one per request. Each round trip is
# sidecar and Redis CPU beside the requests in flight (0.4 ms of a 2 KB keep request's p50 on a
# 2-core machine when sent per request; at one per 50 ms the feedback still cost 0.15 ms of
# sidecar CPU per request, a third of it less at 200 ms). The dispatchers' error metrics are
# rolling windows: a sample 200 ms late changes nothing there.
_FEEDBACK_LINGER_S = 0.2


def normalize_hostport(value: str) -> str | None:
    """``value`` as a canonical lowercase ``host:port``, or None if it is anything else (a
    scheme, a path, user info, a bad port): a header must not smuggle a URL into hop 1."""
    text = value.strip().lower()
    m = _HOSTPORT.fullmatch(text)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        return None
    return text


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Settings of one decode node's sidecar."""

    host: str = "127.0.0.1"  # listen address (0.0.0.0 to take Envoy's traffic from other machines)
    port: int = 8201  # listen port (0: any free port)
    local_vllm: str = "127.0.0.1:8101"  # host:port of this decode node's vLLM OpenAI server
    # host:port of prefill vLLMs hop 1 may always call; the live cluster view adds more at run time
    allowed_prefill_hosts: tuple[str, ...] = field(default_factory=tuple)
    hop1_connect_timeout_s: float = 1.0  # TCP connect to a prefill node
    hop1_timeout_s: float = 30.0  # all of hop 1 (connect, prefill queue + execution, reply); then 504
    # The local vLLM: bound on connect, on waiting for response headers, and on the silence
    # between two body chunks. Not a total: a long generation may stream for minutes.
    hop2_timeout_s: float = 300.0
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies are answered 413
    # Redis for the TTFT feedback stream (redis://host:port/db); empty: no feedback, no Redis.
    redis_url: str = ""
    # host:port of the gateway (Envoy's listener) a batch's prompts are sent back through, one
    # request each (kairos.nodeagent.fanout); empty: a batch routed here is answered 502.
    gateway: str = ""
    # The SLO classes requests are counted by (name=TTFT_MS/TPOT_MS,...: the dispatcher's, as
    # kairos.core.slo.parse_classes reads them); empty: kairos.core.slo.DEFAULT_CLASSES.
    slo_classes: str = ""

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host must not be empty")
        if self.slo_classes.strip():
            parse_classes(self.slo_classes)  # a malformed list fails here, at startup
        if self.redis_url:
            check_redis_url("redis_url", self.redis_url)
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        local = normalize_hostport(self.local_vllm)
        if local is None:
            raise ConfigError(f"local_vllm must be host:port, got {self.local_vllm!r}")
        object.__setattr__(self, "local_vllm", local)
        allowed = []
        for entry in self.allowed_prefill_hosts:
            norm = normalize_hostport(entry)
            if norm is None:
                raise ConfigError(f"allowed_prefill_hosts: expected host:port, got {entry!r}")
            allowed.append(norm)
        object.__setattr__(self, "allowed_prefill_hosts", tuple(dict.fromkeys(allowed)))
        for name in ("hop1_connect_timeout_s", "hop1_timeout_s", "hop2_timeout_s"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ConfigError(f"{name} must be finite and > 0, got {value}")
        if self.hop1_connect_timeout_s > self.hop1_timeout_s:
            raise ConfigError(
                f"hop1_connect_timeout_s ({self.hop1_connect_timeout_s}) must not exceed "
                f"hop1_timeout_s ({self.hop1_timeout_s})"
            )
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.gateway:
            gateway = normalize_hostport(self.gateway)
            if gateway is None:
                raise ConfigError(f"gateway must be host:port, got {self.gateway!r}")
            object.__setattr__(self, "gateway", gateway)

    @property
    def classes(self) -> tuple[SloClass, ...]:
        return parse_classes(self.slo_classes) if self.slo_classes.strip() else DEFAULT_CLASSES


class SidecarMetrics:
    """Prometheus metrics of one sidecar app, in their own registry (served on /kairos/metrics)."""

    def __init__(self, classes: Sequence[SloClass] = DEFAULT_CLASSES) -> None:
        self.registry = CollectorRegistry()
        self.hop1_seconds = Histogram(
            "kairos_sidecar_hop1_seconds",
            "Hop 1 duration: the prefill node's queueing and execution, as seen from the sidecar",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.ttfb_seconds = Histogram(
            "kairos_sidecar_ttfb_seconds",
            "Local vLLM hop sent to its first token (keep: KV transfer + decode queue); streamed responses only",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "kairos_sidecar_ttft_seconds",
            "Request arrival to its first token relayed (a stream's first event): the TTFT the sidecar "
            "accounts for; kairos_sidecar_ttft_unobserved_total counts the requests without one",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        # The live check of the latency models (the paper's section 7 concern): observed TTFT here
        # over the dispatcher's prediction for the path it chose; drifting away from 1 means
        # the profile needs re-fitting.
        self.ttft_vs_predicted = Histogram(
            "kairos_sidecar_ttft_observed_over_predicted",
            "Observed TTFT at the sidecar (streamed responses) divided by the dispatcher's predicted TTFT",
            ["path"],
            buckets=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0),
            registry=self.registry,
        )
        self.ttft_unobserved = Counter(
            "kairos_sidecar_ttft_unobserved",
            "Completion requests without a TTFT sample, by reason: not_streamed (one JSON body, sent after "
            "the last token: the first token is not visible here), error (an error status or event instead "
            "of a first token), aborted (the client left before it)",
            ["path", "reason"],
            registry=self.registry,
        )
        self.hop_errors = Counter(
            "kairos_sidecar_hop_errors",
            "Failed hops; hop 1 = prefill node, hop 2 = local vLLM (every path)",
            ["hop", "kind"],
            registry=self.registry,
        )
        self.local_prefills = Counter(
            "kairos_sidecar_local_prefills",
            "Keep-path requests prefilled on the local vLLM because hop 1 failed (prefill node down, "
            "reset, 5xx or too slow)",
            registry=self.registry,
        )
        self.ttft_feedback = Counter(
            "kairos_sidecar_ttft_feedback",
            "TTFT samples for the dispatchers' feedback stream: sent (XADD done), error (XADD failed), "
            "dropped (queue full, or Redis failed less than a second ago)",
            ["outcome"],
            registry=self.registry,
        )
        # Series exist from the start, so rates work before the first request; each request's are
        # looked up here once, not per request (labels() takes a lock and hashes its labels).
        self.ttfb = {path: self.ttfb_seconds.labels(path) for path in PATHS}
        self.ttft = {path: self.ttft_seconds.labels(path) for path in PATHS}
        self.hop1 = self.hop1_seconds.labels(Route.KEEP)  # only the keep path has a hop 1
        self.ttft_ratio = {path: self.ttft_vs_predicted.labels(path) for path in (Route.KEEP, Route.DEFLECT)}
        self.unobserved = {
            (path, reason): self.ttft_unobserved.labels(path, reason) for path in PATHS for reason in UNOBSERVED
        }
        for outcome in ("sent", "error", "dropped"):
            self.ttft_feedback.labels(outcome)
        # Per SLO class, one series per configured class only (bounded: a request's class is
        # one of them, never a client's value), each created here.
        slo_requests = Counter(
            "kairos_sidecar_slo_requests",
            "Completion requests judged against their own SLOs (TTFT within its TTFT SLO, at most 5% of its "
            "stream's inter-token gaps over its TPOT SLO), by SLO class: met, missed (a stream that broke off "
            "or ended in an error event included), unobserved (not streamed, an error before the first token, "
            "the client left: nothing to judge)",
            ["class", "outcome"],
            registry=self.registry,
        )
        goodput = Counter(
            "kairos_sidecar_slo_goodput_tokens",
            "Output tokens of the completion requests that met their own SLOs, by SLO class (a stream's usage "
            "completion_tokens where it has one, else its token events)",
            ["class"],
            registry=self.registry,
        )
        names = [k.name for k in classes]
        self.slo_requests = {(n, o): slo_requests.labels(n, o) for n in names for o in SLO_OUTCOMES}
        self.slo_goodput_tokens = {n: goodput.labels(n) for n in names}


class TtftFeedbackPublisher:
    """Sends TTFT samples to the feedback stream without ever making a request wait.

    :meth:`offer` only puts the sample on a bounded queue (full: dropped and counted); one writer
    task XADDs what is queued (``MAXLEN ~`` the contract's cap), pipelined, after letting samples
    gather for ``linger_s`` (one round trip per 200 ms at most rather than one per request).
    After a failed round trip the writer drops samples for ``retry_s`` before it tries again, so a
    dead Redis costs one failed attempt per second, not one per request. A failure is logged once
    per outage, and its end once.
    """

    def __init__(
        self,
        redis_url: str,
        metrics: SidecarMetrics,
        *,
        queue_size: int = _FEEDBACK_QUEUE,
        timeout_s: float = _FEEDBACK_TIMEOUT_S,
        retry_s: float = _FEEDBACK_RETRY_S,
        linger_s: float = _FEEDBACK_LINGER_S,
    ) -> None:
        self.redis_url = redis_url
        self._linger_s = linger_s
        self._url = redact_url(redis_url)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._queue: asyncio.Queue[dict[str, str]] = asyncio.Queue(maxsize=queue_size)
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._down_since: float | None = None  # loop time of the first failure of this outage
        self._retry_at = 0.0
        self._lost = 0  # samples not sent during this outage

    def offer(self, rid: str, path: str, node: str, predicted_s: float, observed_s: float) -> None:
        """Queue one sample; never blocks, never raises."""
        f = c.TtftFeedbackField
        sample = {
            f.REQUEST_ID: rid,
            f.PATH: path,
            f.NODE: node,
            f.PREDICTED_MS: f"{predicted_s * 1e3:.3f}",
            f.OBSERVED_MS: f"{observed_s * 1e3:.3f}",
            f.MEASURED: c.TTFT_FEEDBACK_FIRST_TOKEN,
        }
        try:
            self._queue.put_nowait(sample)
        except asyncio.QueueFull:
            self._drop(1)

    async def start(self) -> None:
        # Fail fast, no hidden retries: a sample is worth less than the time a retry would take.
        self._client = fail_fast_client(self.redis_url, self._timeout_s)
        self._task = asyncio.create_task(self._run(), name="kairos-ttft-feedback")
        log.info(
            "TTFT feedback to %s stream %s (MAXLEN ~%d)",
            self._url,
            c.REDIS_TTFT_FEEDBACK_STREAM,
            c.TTFT_FEEDBACK_MAXLEN,
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self._linger_s > 0 and self._queue.qsize() < _FEEDBACK_BATCH - 1:
                await asyncio.sleep(self._linger_s)
            while len(batch) < _FEEDBACK_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if loop.time() < self._retry_at:
                self._drop(len(batch))
                continue
            try:
                await self._send(batch)
            except (RedisError, OSError) as exc:  # OSError covers refused sockets and timeouts
                self._failed(exc, len(batch), loop.time())
            except Exception:  # a bug must not end the writer: the samples are lost, requests are not
                log.exception("TTFT feedback: sending %d samples failed unexpectedly", len(batch))
                self._metrics.ttft_feedback.labels("error").inc(len(batch))
            else:
                self._metrics.ttft_feedback.labels("sent").inc(len(batch))
                self._recovered(loop.time())

    async def _send(self, batch: list[dict[str, str]]) -> None:
        assert self._client is not None, "start() creates the client"
        async with self._client.pipeline(transaction=False) as pipe:
            for sample in batch:
                pipe.xadd(c.REDIS_TTFT_FEEDBACK_STREAM, sample, maxlen=c.TTFT_FEEDBACK_MAXLEN, approximate=True)
            await pipe.execute()

    def _drop(self, n: int) -> None:
        self._metrics.ttft_feedback.labels("dropped").inc(n)
        self._lost += n

    def _failed(self, exc: BaseException, n: int, now: float) -> None:
        self._metrics.ttft_feedback.labels("error").inc(n)
        self._lost += n
        self._retry_at = now + self._retry_s
        if self._down_since is None:
            self._down_since = now
            text = str(exc).strip()
            log.warning(
                "TTFT feedback: redis at %s failed (%s%s); dropping samples until it answers, retrying every "
                "%gs (requests are not affected; logged once per outage)",
                self._url,
                type(exc).__name__,
                f": {text}" if text else "",
                self._retry_s,
            )

    def _recovered(self, now: float) -> None:
        if self._down_since is not None:
            log.info(
                "TTFT feedback: redis at %s answers again after %.1fs; %d samples were lost",
                self._url,
                now - self._down_since,
                self._lost,
            )
            self._down_since = None
        self._lost = 0


@dataclass
class _State:
    config: SidecarConfig
    allowlist: Callable[[], Collection[str]] | None
    metrics: SidecarMetrics
    # The lean HTTP/1.1 clients, created on app startup: hop 1's to the prefill nodes (one JSON
    # reply per request), and the local vLLM's (hop 2, pass-through, health), replies streamed.
    hop1_client: Http1Client | None = None
    local_client: Http1Client | None = None
    logged_unrouted: bool = False
    feedback: TtftFeedbackPublisher | None = None  # only with a redis_url
    classes: tuple[SloClass, ...] = DEFAULT_CLASSES  # the SLO classes requests are counted by

    @property
    def local(self) -> Http1Client:
        assert self.local_client is not None, "the client is created on app startup"
        return self.local_client


STATE: web.AppKey[_State] = web.AppKey("kairos_sidecar_state", _State)
METRICS: web.AppKey[SidecarMetrics] = web.AppKey("kairos_sidecar_metrics", SidecarMetrics)


class _PrefillHostNotAllowedError(UpstreamError):
    """The routing header named a prefill host that is on no allowlist (answered 502)."""


@dataclass
class _Timing:
    """TTFT parts of one request, for the metrics and the per-request DEBUG line."""

    path: str
    started: float = field(default_factory=time.perf_counter)
    hop1_s: float | None = None
    ttfb_s: float | None = None
    ttft_s: float | None = None
    unobserved: str | None = None  # why ttft_s is None (one of UNOBSERVED), once known
    predicted_s: float | None = None  # the dispatcher's TTFT prediction for the path it chose
    node: str = ""  # the decode node the dispatcher named (the feedback sample's node)
    # Its SLO judgement: the class it is counted in (None: not judged here, a batch's fan-out),
    # the SLOs it is judged by, and what its stream showed (set at the stream's end).
    slo_class: str | None = None
    slo: RequestSLO = DEFAULT_SLO
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each token chunk after the first
    token_events: int = 0
    stream_tail: bytes = b""  # the stream's last two chunks (its usage and [DONE], or an error event)
    stream_end: str | None = None  # "complete" or "failed" (None: not streamed to its end)


def _judged_by(headers: Mapping[str, str], classes: Sequence[SloClass]) -> tuple[str, RequestSLO]:
    """The class a request is counted in and the SLOs it is judged by: its own (the client's
    ``x-slo-*`` headers), else those the dispatcher decided it by, else the cluster's defaults,
    as ``kairos replay`` judges it (with an SLO-blind policy the dispatcher decides by the
    cluster's, but a request is still judged by its own). The class: the dispatcher's where it
    names one of ``classes``, else the class those SLOs fall in."""
    try:
        decided = request_slo(headers.get(c.H_DECIDED_TTFT_SLO_MS), headers.get(c.H_DECIDED_TPOT_SLO_MS))
    except InvalidRequestError:
        decided = DEFAULT_SLO
    try:
        slo = request_slo(headers.get(c.H_SLO_TTFT_MS), headers.get(c.H_SLO_TPOT_MS), 0, decided.ttft_s, decided.tpot_s)
    except InvalidRequestError:  # the gateway answers such a request 400; one sent here directly is judged as decided
        slo = decided
    named = headers.get(c.H_SLO_CLASS)
    if named is not None and any(k.name == named for k in classes):
        return named, slo
    return classify(slo.ttft_s, slo.tpot_s, classes), slo


def _gaps_over(first_at: float, arrivals: Sequence[float], tpot_s: float) -> int:
    """How many of a stream's gaps (between its token chunks' arrivals, from its first) exceed ``tpot_s``."""
    over, previous = 0, first_at
    for at in arrivals:
        over += at - previous > tpot_s
        previous = at
    return over


def _output_tokens(tail: bytes, token_events: int) -> int:
    """A stream's output tokens: its usage's completion_tokens where it has one (the client asked
    for it, or continuous usage stats), else its token events (one token each on vLLM, unless a
    step emits several: speculative decoding)."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else token_events


def _slo_outcome(timing: _Timing) -> tuple[str, int]:
    """(outcome, output tokens) of a judged request at its end."""
    if timing.ttft_s is None or timing.stream_end is None:
        return SLO_UNOBSERVED, 0  # no first token, not streamed, or the client left
    if timing.stream_end != "complete" or _ERROR_EVENT.search(timing.stream_tail):
        return SLO_MISSED, 0  # it broke off or ended in an error after its first token
    first_at = timing.started + timing.ttft_s
    gaps = timing.arrivals
    met = meets_slo(timing.ttft_s, timing.slo.ttft_s, _gaps_over(first_at, gaps, timing.slo.tpot_s), len(gaps))
    return (SLO_MET, _output_tokens(timing.stream_tail, timing.token_events)) if met else (SLO_MISSED, 0)


def _predicted_ttft_s(headers: Mapping[str, str], route: str | None) -> float | None:
    name = {Route.KEEP: c.H_PRED_TTFT_PREFILL_MS, Route.DEFLECT: c.H_PRED_TTFT_DECODE_MS}.get((route or "").lower())
    try:
        return float(headers[name]) / 1e3 if name and name in headers else None
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------
def build_app(config: SidecarConfig, allowlist: Callable[[], Collection[str]] | None = None) -> web.Application:
    """The sidecar's aiohttp app. ``allowlist`` returns the prefill hosts (host:port) the live
    cluster view knows; a prefill host is allowed if it is in ``config.allowed_prefill_hosts``
    or in that callable's current result."""
    # Bodies are read by _read_body with our own bound; this is only aiohttp's backstop.
    # auto_decompress off: a compressed body is refused (415) by the handler; aiohttp would
    # inflate it unbounded, or drop the connection on a body that is not what its label says.
    app = web.Application(client_max_size=config.max_body_bytes + 1, handler_args={"auto_decompress": False})
    classes = config.classes
    state = _State(config=config, allowlist=allowlist, metrics=SidecarMetrics(classes), classes=classes)
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
                queue_size=_FEEDBACK_QUEUE,
                timeout_s=_FEEDBACK_TIMEOUT_S,
                retry_s=_FEEDBACK_RETRY_S,
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
    timing = _Timing(PATH_LOCAL if route is None else route.strip().lower())
    timing.predicted_s = _predicted_ttft_s(request.headers, route)
    timing.node = request.headers.get(c.H_DECODE_NODE) or state.config.local_vllm
    timing.slo_class, timing.slo = _judged_by(request.headers, state.classes)
    status = 0
    try:
        _check_identity_encoding(request.headers)
        raw = await _read_body(request, state.config.max_body_bytes)
        body = _parse_object(raw)
        scrubbed = _scrub_client_fields(body, rid)
        clean = body if scrubbed is None else scrubbed
        headers = _forward_headers(request.headers, rid)
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
            data = raw if scrubbed is None else _dumps(scrubbed)
        elif timing.path == Route.KEEP:
            prefill_host = _prefill_host(state, request.headers, rid)
            try:
                prefilled = await _hop1(state, request.path, prefill_host, clean, headers, rid, timing)
            except UpstreamError as exc:
                # The prefill node failed it before a byte reached the client (dead, reset, 5xx,
                # no answer in time): the local vLLM prefills it, as it would with no prefill pool.
                # Envoy's retry could only reach another decode node whose hop 1 calls the same
                # prefill node.
                log.warning("request %s: %s; prefilling it on the local vLLM instead", rid, exc.message)
                state.metrics.local_prefills.inc()
                prefilled = None
            if isinstance(prefilled, web.Response):
                status = prefilled.status
                return prefilled
            local = _local_prefill_body(state, clean, request.headers, rid) if prefilled is None else None
            hop2 = {**clean, c.KV_TRANSFER_PARAMS: prefilled} if local is None else local
            data = _dumps(_with_tpot_slo(state, hop2, request.headers, rid))
        elif timing.path == Route.DEFLECT:
            deflected = _deflect_body(state, clean, request.headers, rid)
            data = _dumps(_with_tpot_slo(state, deflected, request.headers, rid))
        else:
            _count(state, "2", "bad_routing_headers")
            routes = f"{Route.KEEP.value!r} nor {Route.DEFLECT.value!r}"
            raise _bad_routing(rid, f"{c.H_ROUTE}={route!r} is neither {routes}")
        if data is not raw:
            headers[hdrs.CONTENT_TYPE] = "application/json"  # we wrote this body
        response = await _relay(request, state, data, headers, rid, timing)
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


async def _pass_through(request: web.Request) -> web.StreamResponse:
    """Everything but the completion routes (``/v1/models``, ``/metrics``, ``/tokenize``, ...):
    the local vLLM's answer, unchanged."""
    state = request.app[STATE]
    rid = request.headers.get(c.H_REQUEST_ID) or uuid.uuid4().hex
    try:
        _check_identity_encoding(request.headers)
        data = await _read_body(request, state.config.max_body_bytes) if request.body_exists else None
        return await _relay(request, state, data, _forward_headers(request.headers, rid), rid, None)
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


# --------------------------------------------------------------------------------------------
# Request side
# --------------------------------------------------------------------------------------------
class PayloadTooLargeError(InvalidRequestError):
    """The request body exceeds ``SidecarConfig.max_body_bytes`` (413, by kairos.common.http_errors' table)."""

    code = "payload_too_large"


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, read up to ``limit`` bytes: a chunked upload cannot get past the bound either."""
    message = f"request body exceeds the sidecar's limit of {limit} bytes"
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLargeError(message)
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLargeError(message)
    return bytes(buf)


def _check_identity_encoding(headers: CIMultiDictProxy[str]) -> None:
    """Bodies are JSON as sent: a compressed one is a 415 (vLLM does not decode request bodies
    either), before aiohttp tries to inflate it."""
    encoding = headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedContentEncodingError(
            f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed"
        )


def _parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of valid Unicode text: strict UTF-8 (json.loads on bytes would
    let encoded surrogates through), and no lone surrogate from a \\u escape either, since the
    body is encoded again for the hops."""
    try:
        body = _loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    if b"\\ud" in raw or b"\\uD" in raw:  # JSON escapes are \u + hex digits, either case
        try:
            _json_dumps(body)
        except UnicodeEncodeError:
            raise InvalidRequestError("request body has an unpaired UTF-16 surrogate escape") from None
    return body


def _forward_headers(incoming: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    """The client's headers for a hop: no hop-by-hop headers (nor those named in Connection), no
    ``x-kairos-*`` (routing is ours, not vLLM's), and the request id that every hop shares."""
    named_in_connection = {
        token.strip().lower() for value in incoming.getall(hdrs.CONNECTION, ()) for token in value.split(",")
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in _REQUEST_DROP or lower in named_in_connection or lower.startswith(c.HEADER_PREFIX):
            continue
        out.add(name, value)
    out[c.H_REQUEST_ID] = rid
    # Identity unless the client asked otherwise: hop 2 is relayed byte for byte anyway.
    out[hdrs.ACCEPT_ENCODING] = incoming.get(hdrs.ACCEPT_ENCODING, "identity")
    return out


def _scrub_client_fields(body: dict[str, Any], rid: str) -> dict[str, Any] | None:
    """A copy of ``body`` without what only Kairos may set, or None when it has none of it:
    client-sent ``kairos_*`` vllm_xargs (a chunk schedule is the dispatcher's, as the edge strips
    ``x-kairos-*`` headers) and ``kv_transfer_params`` (the P/D hand-off is the sidecar's: a
    client's would make a node hold KV, or pull it from anywhere)."""
    xargs = body.get(c.VLLM_XARGS)
    spoofed_xargs = isinstance(xargs, dict) and any(str(k).startswith(c.XARG_PREFIX) for k in xargs)
    if not spoofed_xargs and c.KV_TRANSFER_PARAMS not in body:
        return None
    out = dict(body)
    if c.KV_TRANSFER_PARAMS in out:
        del out[c.KV_TRANSFER_PARAMS]
        log.warning("request %s: removed client-sent %s", rid, c.KV_TRANSFER_PARAMS)
    if spoofed_xargs:
        assert isinstance(xargs, dict)
        kept = {k: v for k, v in xargs.items() if not str(k).startswith(c.XARG_PREFIX)}
        log.warning("request %s: removed client-sent %s %s", rid, c.VLLM_XARGS, sorted(set(xargs) - set(kept)))
        if kept:
            out[c.VLLM_XARGS] = kept
        else:
            del out[c.VLLM_XARGS]
    return out


def _bad_routing(rid: str, detail: str) -> UpstreamError:
    # The routing headers come from our own dispatcher, so a bad one is a gateway fault (502),
    # never the client's (400).
    log.error("request %s: bad routing headers from the dispatcher: %s", rid, detail)
    return UpstreamError(f"bad routing headers: {detail}")


def _prefill_host(state: _State, headers: CIMultiDictProxy[str], rid: str) -> str:
    value = headers.get(c.H_PREFILL_HOST)
    if value is None:
        _count(state, "1", "bad_routing_headers")
        raise _bad_routing(rid, f"{c.H_ROUTE}=keep without {c.H_PREFILL_HOST}")
    host = normalize_hostport(value)
    if host is None:
        _count(state, "1", "bad_routing_headers")
        raise _bad_routing(rid, f"{c.H_PREFILL_HOST}={value!r} is not host:port")
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
    _count(state, "1", "not_allowed")
    log.warning(
        "request %s: refused to call prefill host %s: it is neither in allowed_prefill_hosts %s nor in the "
        "live cluster view",
        rid,
        host,
        list(state.config.allowed_prefill_hosts),
    )
    raise _PrefillHostNotAllowedError(f"prefill host {host} is not on this sidecar's allowlist")


def _deflect_body(state: _State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str) -> dict[str, Any]:
    raw_schedule = headers.get(c.H_CHUNK_SCHEDULE)
    if raw_schedule is None:
        _count(state, "2", "bad_routing_headers")
        raise _bad_routing(rid, f"{c.H_ROUTE}=deflect without {c.H_CHUNK_SCHEDULE}")
    raw_budget = headers.get(c.H_STEP_BUDGET_MS)
    try:
        schedule = c.parse_chunk_schedule_header(raw_schedule)
        budget_ms = None if raw_budget is None else c.parse_step_budget_ms(raw_budget)
    except c.MalformedSchedule as exc:
        _count(state, "2", "bad_routing_headers")
        raise _bad_routing(rid, str(exc)) from None
    return _scheduled_body(body, schedule, budget_ms)


def _scheduled_body(body: dict[str, Any], schedule: Sequence[int], budget_ms: float | None) -> dict[str, Any]:
    """The client's own xargs (kairos_* already scrubbed) and a schedule (and step budget)."""
    xargs = body.get(c.VLLM_XARGS)
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidRequestError(f"{c.VLLM_XARGS} must be an object, got {type(xargs).__name__}")
    return {**body, c.VLLM_XARGS: {**(xargs or {}), **c.schedule_xargs(schedule, budget_ms)}}


def _with_tpot_slo(state: _State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str) -> dict[str, Any]:
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
        _count(state, "2", "bad_routing_headers")
        raise _bad_routing(rid, str(exc)) from None
    xargs = body.get(c.VLLM_XARGS)
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidRequestError(f"{c.VLLM_XARGS} must be an object, got {type(xargs).__name__}")
    return {**body, c.VLLM_XARGS: {**(xargs or {}), c.XARG_TPOT_SLO_MS: tpot_ms}}


def _local_prefill_body(
    state: _State, body: dict[str, Any], headers: CIMultiDictProxy[str], rid: str
) -> dict[str, Any]:
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
        _count(state, "2", "bad_routing_headers")
        raise _bad_routing(rid, str(exc)) from None
    raw_tokens = headers.get(c.H_PROMPT_TOKENS, "")
    whole = int(raw_tokens) if raw_tokens.isdecimal() and int(raw_tokens) > 0 else defaults.MAX_MODEL_LEN
    return _scheduled_body(body, (whole,), budget_ms)


def _hop1_body(body: dict[str, Any]) -> dict[str, Any]:
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


# --------------------------------------------------------------------------------------------
# Hops
# --------------------------------------------------------------------------------------------
async def _hop1(
    state: _State,
    api_path: str,
    prefill_host: str,
    body: dict[str, Any],
    headers: CIMultiDict[str],
    rid: str,
    timing: _Timing,
) -> dict[str, Any] | web.Response:
    """Prefill on ``prefill_host``: its ``kv_transfer_params``, or the response to relay (4xx)."""
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
                "POST", prefill_host, api_path, _dumps(_hop1_body(body)), hop_headers.items()
            )
    except TimeoutError:
        _count(state, "1", "timeout")
        elapsed = time.perf_counter() - started
        # The connect timeout is a TimeoutError too: say which bound ran out.
        what = "gave no answer" if deadline.expired() else "could not be connected to"
        log.warning("request %s: prefill node %s %s in %.2fs", rid, prefill_host, what, elapsed)
        raise UpstreamTimeoutError(f"prefill node {prefill_host} {what} within {elapsed:.1f}s") from None
    except ConnectFailed as exc:
        _count(state, "1", "connect")
        log.warning("request %s: cannot connect to prefill node %s: %s", rid, prefill_host, exc.os_error)
        raise UpstreamError(f"cannot connect to prefill node {prefill_host}: {exc.os_error}") from None
    except (Http1Error, OSError) as exc:
        _count(state, "1", "connection")
        log.warning("request %s: prefill node %s: connection failed: %r", rid, prefill_host, exc)
        raise UpstreamError(f"prefill node {prefill_host}: connection failed ({type(exc).__name__})") from None
    raw, status = reply.body, reply.status
    content_type = reply.headers.get("content-type", "application/json")
    elapsed = time.perf_counter() - started
    if 400 <= status < 500:
        # The prefill vLLM validated the client's own request (prompt too long, bad parameter):
        # its answer is the client's to see, as it would be without disaggregation.
        _count(state, "1", "status_4xx")
        log.info("request %s: prefill node %s answered %d; relayed to the client", rid, prefill_host, status)
        return web.Response(status=status, body=raw, headers={hdrs.CONTENT_TYPE: content_type, c.H_REQUEST_ID: rid})
    if status >= 300:
        _count(state, "1", f"status_{status // 100}xx")
        snippet = raw[:_ERROR_SNIPPET].decode("utf-8", "replace")
        log.warning("request %s: prefill node %s answered %d: %s", rid, prefill_host, status, snippet)
        raise UpstreamError(f"prefill node {prefill_host} answered {status}: {snippet}")
    try:
        reply = _loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        reply = None
    params = reply.get(c.KV_TRANSFER_PARAMS) if isinstance(reply, dict) else None
    if not isinstance(params, dict):
        _count(state, "1", "no_kv_transfer_params")
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


async def _relay(
    request: web.Request,
    state: _State,
    data: bytes | None,
    headers: CIMultiDict[str],
    rid: str,
    timing: _Timing | None,
) -> web.StreamResponse:
    """Send the request to the local vLLM and relay its answer: JSON whole, anything else (SSE)
    chunk by chunk as it arrives. 5xx and connection failures become our 502/504."""
    cfg = state.config
    target = request.raw_path if request.raw_path.startswith("/") else request.rel_url.raw_path_qs
    t = cfg.hop2_timeout_s
    started = time.perf_counter()
    try:
        async with asyncio.timeout(t):  # connect and the response's head; the body's silences are read's
            resp = await state.local.open(request.method, cfg.local_vllm, target, data, headers.items())
    except TimeoutError:
        _count(state, "2", "timeout")
        log.warning("request %s: the local vLLM %s gave no answer in %gs", rid, cfg.local_vllm, t)
        raise UpstreamTimeoutError(f"the local vLLM did not answer within {t:g}s") from None
    except (Http1Error, OSError) as exc:
        _count(state, "2", "connect" if isinstance(exc, ConnectFailed) else "connection")
        log.warning("request %s: the local vLLM %s failed: %r", rid, cfg.local_vllm, exc)
        raise UpstreamError(f"the local vLLM failed: {type(exc).__name__}") from None

    try:
        head = resp.head
        if head.status >= 500:
            _count(state, "2", "status_5xx")
            snippet = await _snippet(resp, t)
            log.warning("request %s: the local vLLM answered %d: %s", rid, head.status, snippet)
            raise UpstreamError(f"the local vLLM answered {head.status}: {snippet}")
        ok = head.status < 400
        dropped = _RESPONSE_DROP | _named_in_connection(head.headers.get("connection", ""))
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
                _count(state, "2", "timeout")
                raise UpstreamTimeoutError(f"the local vLLM stalled for {t:g}s mid-response") from None
            except Http1Error as exc:
                _count(state, "2", "broken")
                raise UpstreamError(f"the local vLLM broke off its response: {type(exc).__name__}") from None
            if timing is not None:
                # A completion's body is written after its last token: its first byte is no TTFT
                # (the module docstring says why the sidecar does not rebuild it from a stream).
                timing.unobserved = NOT_STREAMED if ok else UNOBSERVED_ERROR
            return web.Response(status=head.status, body=b"".join(parts), headers=out_headers)

        feedback = state.feedback

        def first_event(chunk: bytes) -> None:
            """The stream's first bytes: its first token, unless the node answered an error."""
            if timing is None:
                return
            if not ok or _ERROR_EVENT.match(chunk):
                timing.unobserved = UNOBSERVED_ERROR
                return
            now = time.perf_counter()
            timing.ttfb_s = now - started
            timing.ttft_s = now - timing.started
            if feedback and timing.predicted_s and timing.path in (Route.KEEP, Route.DEFLECT):
                # Queued now; the writer runs at its next wait, after this chunk is written.
                feedback.offer(rid, timing.path, timing.node, timing.predicted_s, timing.ttft_s)

        return await _stream(request, state, resp, out_headers, first_event, rid, timing)
    finally:
        resp.close()  # before the body's end this drops the connection, so vLLM aborts the request


async def _stream(
    request: web.Request,
    state: _State,
    resp: Response,
    out_headers: CIMultiDict[str],
    first_event: Callable[[bytes], None],
    rid: str,
    timing: _Timing | None = None,
) -> web.StreamResponse:
    """Relay a streaming body (SSE) chunk by chunk: each chunk is written to the client's socket as
    soon as it arrives (aiohttp writes straight to the transport; TCP_NODELAY is on). For a
    request judged against its SLOs, the arrival of each chunk after the first that carries a
    token, and the token events, for :func:`_slo_outcome` at the end. A chunk is what one read
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
        while chunk := await resp.read(t):
            if first:
                first_event(chunk)
                first = False
                events = chunk.count(_CHOICE_KEY) - chunk.count(_ROLE_KEY)
            elif judged and (n := chunk.count(_CHOICE_KEY)):  # the hot path: a count, a clock read, an append
                arrivals.append(clock())
                events += n
            await out.write(chunk)
            previous, last = last, chunk
    except ConnectionResetError:
        # The client went away (aiohttp's ClientConnectionResetError also lands here). Leaving
        # lets _relay close the upstream connection, which makes vLLM abort the generation.
        log.info("request %s: the client disconnected mid-stream; aborting the upstream request", rid)
        return out
    except TimeoutError:
        _count(state, "2", "timeout")
        failure = UpstreamTimeoutError(f"the local vLLM stalled for {t:g}s mid-stream")
    except Http1Error as exc:
        _count(state, "2", "broken")
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
                await out.write(sep + b"data: " + _dumps(error_body(failure)) + b"\n\n")
        else:
            # No way to signal it in-band: cut the connection so the body reads as truncated.
            if request.transport is not None:
                request.transport.close()
            return out
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()
    return out


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _named_in_connection(value: str) -> set[str]:
    """The header names a Connection header's value lists (hop-by-hop, RFC 9110 §7.6.1)."""
    return {token.strip().lower() for token in value.split(",") if token.strip()}


async def _snippet(resp: Response, timeout_s: float) -> str:
    """The start of an error reply's body, for our own error message."""
    raw = b""
    try:
        while len(raw) < _ERROR_SNIPPET and (chunk := await resp.read(timeout_s)):
            raw += chunk
    except (Http1Error, TimeoutError):
        if not raw:
            return "(no body)"
    return raw[:_ERROR_SNIPPET].decode("utf-8", "replace")


class _NonFinite(float):
    """NaN or an infinity read from a body (json.loads takes them): orjson would write null for
    them, so it refuses this type instead and :func:`_dumps` falls back to json."""


# One decoder for every body: json.loads with an argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_NonFinite)


def _loads(text: str) -> Any:
    return _DECODER.decode(text)


def _json_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of a body read by :func:`_loads`, the JSON json.dumps writes (the same
    values; floats may be spelled differently, 1e-7 for 1e-07). orjson takes 3 us where json
    takes 0.5 ms on a 100 KB prompt, and the keep path writes two bodies; what orjson refuses
    (NaN and infinities, integers past 64 bits, lone surrogates) is json's, as before."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return _json_dumps(obj)


def _count(state: _State, hop: str, kind: str) -> None:
    state.metrics.hop_errors.labels(hop, kind).inc()


def _error_response(exc: BaseException, rid: str) -> web.Response:
    return web.Response(
        status=error_status(exc),
        body=error_json(exc),
        headers={hdrs.CONTENT_TYPE: "application/json", c.H_REQUEST_ID: rid},
    )


def _observe(state: _State, timing: _Timing, rid: str, status: int) -> None:
    m = state.metrics
    path = timing.path if timing.path in PATHS else PATH_LOCAL
    if timing.hop1_s is not None:
        m.hop1.observe(timing.hop1_s)
    if timing.ttfb_s is not None:
        m.ttfb[path].observe(timing.ttfb_s)
    if timing.ttft_s is not None:
        m.ttft[path].observe(timing.ttft_s)
        ratio = m.ttft_ratio.get(path)  # a prediction comes with the keep and deflect routes only
        if timing.predicted_s and ratio is not None:
            ratio.observe(timing.ttft_s / timing.predicted_s)
    else:
        # No status: the handler never returned a response (cancelled: its client left).
        reason = timing.unobserved or (UNOBSERVED_ERROR if status else ABORTED)
        m.unobserved[path, reason].inc()
    if timing.slo_class is not None:
        outcome, tokens = _slo_outcome(timing)
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


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = SERVICE.parser()
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8201; 0 for any free port)")
    p.add_argument("--local-vllm", help="host:port of this decode node's vLLM (default 127.0.0.1:8101)")
    p.add_argument(
        "--allow-prefill",
        dest="allowed_prefill_hosts",
        metavar="ALLOW_PREFILL",
        help="comma-separated host:port of prefill vLLMs hop 1 may call",
    )
    p.add_argument("--hop1-connect-timeout-s", type=float)
    p.add_argument("--hop1-timeout-s", type=float)
    p.add_argument("--hop2-timeout-s", type=float)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument(
        "--redis",
        dest="redis_url",
        metavar="REDIS",
        help="redis://host:port/db for the TTFT feedback stream (default: off)",
    )
    p.add_argument("--gateway", help="host:port of the gateway (Envoy) a batch's prompts are sent back through")
    p.add_argument(
        "--slo-classes",
        help="the SLO classes requests are counted by, name=TTFT_MS/TPOT_MS comma-separated, as the "
        f"dispatcher's (default {format_classes(DEFAULT_CLASSES)})",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sidecar until SIGTERM or SIGINT. Settings: defaults < YAML < KAIROS_SIDECAR_* env < flags."""
    args = build_parser().parse_args(argv)
    return SERVICE.run(args, flag_overrides(args))


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


SERVICE = Service("sidecar", __doc__.split("\n\n")[0], SidecarConfig, "sidecar", "KAIROS_SIDECAR_", serve, uvloop=True)


if __name__ == "__main__":
    sys.exit(main())
