"""Renders the Envoy configuration (``envoy/envoy.yaml.j2``, packaged as ``kairos.envoy``) for a topology."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable

import jinja2

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.errors import ConfigError
from kairos.common.http_errors import ERROR_TABLE
from kairos.core.admission import AdmissionLimits

# Package data wherever kairos-gateway is installed (pyproject.toml maps envoy/ to kairos.envoy).
TEMPLATE = resources.files("kairos.envoy") / "envoy.yaml.j2"
# How Envoy finds its upstreams: STATIC takes IP addresses as they are (kairos up, loopback);
# STRICT_DNS resolves host names and keeps re-resolving them (docker compose service names).
CLUSTER_TYPES = ("STATIC", "STRICT_DNS")


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"expected host:port, got {endpoint!r}")
    return host, int(port)


@dataclass(frozen=True)
class EnvoySettings:
    """What differs between deployments of the gateway's Envoy."""

    listen_host: str = "0.0.0.0"
    listen_port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int = 9901
    dispatchers: tuple[str, ...] = ("127.0.0.1:9000",)  # ext_proc gRPC endpoints (host:port)
    sidecars: tuple[str, ...] = field(default_factory=tuple)  # decode-node sidecars (host:port)
    buffer_limit_bytes: int = 16 * 1024 * 1024  # above the dispatcher's own (defaults.MAX_REQUEST_BODY_BYTES)
    message_timeout: str = "2s"  # a slower dispatcher answer gives 504
    stream_idle_timeout: str = "300s"
    # An idle connection to a sidecar closes on Envoy's side first (defaults.GATEWAY_SIDECAR_IDLE_S).
    sidecar_idle_timeout: str = f"{defaults.GATEWAY_SIDECAR_IDLE_S:g}s"
    # How often Envoy health-checks each dispatcher replica (grpc.health.v1), and how long an
    # answer may take: a stopped (frozen) replica is out after one missed check, ~0.75 s, where
    # 1 s and two checks let it hold requests for 2.5 s (8 of 90 lost to a 2 s message timeout
    # at 6 RPS, bench/live/fault_counts.py frozen-dispatcher).
    health_check_interval: str = "0.5s"
    health_check_timeout: str = "0.25s"
    # Retries in flight per cluster (Envoy's default is 3): one per request that a dead
    # dispatcher replica or decode node makes Envoy retry.
    max_retries: int = 1024
    # Client connections Envoy holds at once (its overload manager; past it, it stops accepting
    # and the kernel's backlog waits). Each request in flight holds one, and an HTTP/1 connection
    # to a sidecar: two open files, 16,384 with Envoy's own under a 20,000 open-file limit. Also
    # the ext_proc and sidecar clusters' circuit breakers: one stream and one upstream request per
    # client connection, so no breaker trips before this limit does (HTTP/2 clients, many streams
    # on one connection, can still meet the breakers: Envoy then answers a JSON 503).
    max_downstream_connections: int = 8192
    # ext_proc streams open on each dispatcher replica at once (HTTP/2 max_concurrent_streams on
    # its one connection): what one decides within the message timeout
    # (defaults.DISPATCHER_MAX_OPEN_STREAMS says why); the rest wait in Envoy for a stream.
    dispatcher_streams: int = defaults.DISPATCHER_MAX_OPEN_STREAMS
    # Connections the kernel queues before Envoy accepts them (its default, 128, drops the SYNs of
    # a burst, which clients resend only after 1 s, 3 s, ...); the kernel caps it at somaxconn.
    listen_backlog: int = 4096
    # Envoy's heap: past 90% it returns freed memory to the system, past 95% it answers new
    # requests 503 itself. Envoy peaked at 285 MB with 5,000 streams opened at once
    # (bench/results/spike.json); each connection may buffer a body up to buffer_limit_bytes, so
    # this is what bounds a flood of large bodies.
    max_heap_bytes: int = 1024 * 1024 * 1024
    # Until the whole request (headers and body) is in: a client that stalls mid-body gets a
    # 408 instead of holding a buffer and a connection for stream_idle_timeout. It stops at the
    # last request byte, so it never cuts a long SSE response.
    request_timeout: str = "60s"
    request_headers_timeout: str = "10s"
    # Both clusters. With STRICT_DNS a host's address is its resolved IPv4 address, and that is
    # what the dispatcher's override_host destinations are matched against: the sidecars must
    # then advertise (heartbeat --sidecar) the IP their name resolves to.
    cluster_type: str = "STATIC"

    def __post_init__(self) -> None:
        if self.cluster_type not in CLUSTER_TYPES:
            raise ConfigError(f"cluster_type must be one of {list(CLUSTER_TYPES)}, got {self.cluster_type!r}")
        if not self.dispatchers:
            raise ConfigError("Envoy needs at least one dispatcher endpoint")
        if not self.sidecars:
            raise ConfigError("Envoy needs at least one decode sidecar endpoint")
        for e in (*self.dispatchers, *self.sidecars):
            _split(e)


@dataclass(frozen=True, slots=True)
class LocalReply:
    """How Envoy words one of its own error replies: ``code`` is an http_errors code (its type
    comes from the one table); ``message`` may hold Envoy format operators. ``reply_status``:
    the status the client gets instead of ``status``; ``retry_after_s``: a Retry-After header."""

    status: int
    code: str
    message: str
    reply_status: int | None = None
    retry_after_s: int | None = None

    @property
    def error_type(self) -> str:
        return ERROR_TABLE[self.code].type


NOT_FOUND_TEXT = "no such endpoint: this gateway serves " + ", ".join(
    f"{'/'.join(methods)} {path}" for path, methods in c.PUBLIC_ENDPOINTS.items()
)
_DETAILS = "(%RESPONSE_CODE_DETAILS%)"  # Envoy's reason, e.g. ext_proc_error_gRPC_error_14
RETRY_AFTER_S = AdmissionLimits().retry_after_s  # as the dispatcher's own 429 says
LOCAL_REPLIES: tuple[LocalReply, ...] = (
    LocalReply(400, "invalid_request", f"the gateway could not read the HTTP request {_DETAILS}"),
    # The catch-all route's text, and also the answer when no route matches at all (OPTIONS *,
    # whose reply has no body of its own to quote).
    LocalReply(404, "not_found", NOT_FOUND_TEXT),
    LocalReply(408, "request_timeout", f"the request was not received in time {_DETAILS}"),
    LocalReply(413, "payload_too_large", f"request body is over the gateway's buffer limit {_DETAILS}"),
    LocalReply(431, "request_headers_too_large", f"request headers are too large {_DETAILS}"),
    LocalReply(502, "upstream_error", f"the gateway could not reach a decode node {_DETAILS}"),
    # An overloaded gateway: a dispatcher that did not answer within the message timeout (its
    # gRPC deadline, ext_proc_error_gRPC_error_1{CANCELLED}, or Envoy's timer, a 504) or no
    # healthy one. A 503 with Retry-After, as the dispatcher's own 429 has: a client that backs off
    # is served once the burst is past (bench/results/spike.json). The route timeout is off, so
    # Envoy's only other 504 is a node silent for stream_idle_timeout: unavailable too.
    LocalReply(
        503,
        "no_healthy_node",
        f"no dispatcher or decode node could take the request {_DETAILS}",
        retry_after_s=RETRY_AFTER_S,
    ),
    LocalReply(
        504,
        "no_healthy_node",
        f"the gateway is overloaded: the dispatcher or a node did not answer in time {_DETAILS}",
        reply_status=503,
        retry_after_s=RETRY_AFTER_S,
    ),
)
# Any other status Envoy answers itself: the same shape, with no code.
FALLBACK_REPLY_MESSAGE = f"the gateway could not serve the request {_DETAILS}"


def path_regex(paths: Iterable[str]) -> str:
    """An RE2 regex matching exactly ``paths`` (Envoy matches it without the query)."""
    return "|".join(re.escape(path) for path in paths)


def render_envoy_config(settings: EnvoySettings, template: Traversable = TEMPLATE) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["json"] = json.dumps  # a YAML-safe quoted string (JSON is YAML)
    return env.from_string(template.read_text(encoding="utf-8")).render(
        public_path_regex=path_regex(c.PUBLIC_ENDPOINTS),
        inference_path_regex=path_regex(c.INFERENCE_PATHS),
        # A request with its own SLOs takes the headers route too: the dispatcher reads them there.
        routing_headers=(*c.ROUTING_HEADERS, *c.SLO_HEADERS),
        routed_headers=(c.H_REQUEST_ID, *c.ROUTING_HEADERS),
        routing_metadata=c.ROUTING_METADATA_NAMESPACE,
        head_attributes=list(c.HEAD_ATTRIBUTES),
        # A longer declared body takes the headers route, where the dispatcher refuses it (413)
        # before it is sent.
        one_message_body_bytes=min(settings.buffer_limit_bytes, defaults.MAX_REQUEST_BODY_BYTES),
        not_found_text=NOT_FOUND_TEXT,
        local_replies=LOCAL_REPLIES,
        fallback_reply_message=FALLBACK_REPLY_MESSAGE,
        request_timeout=settings.request_timeout,
        request_headers_timeout=settings.request_headers_timeout,
        listen_host=settings.listen_host,
        listen_port=settings.listen_port,
        admin_host=settings.admin_host,
        admin_port=settings.admin_port,
        dispatchers=[_split(e) for e in settings.dispatchers],
        sidecars=[_split(e) for e in settings.sidecars],
        buffer_limit_bytes=settings.buffer_limit_bytes,
        message_timeout=settings.message_timeout,
        stream_idle_timeout=settings.stream_idle_timeout,
        sidecar_idle_timeout=settings.sidecar_idle_timeout,
        health_check_interval=settings.health_check_interval,
        health_check_timeout=settings.health_check_timeout,
        ext_proc_service=c.EXT_PROC_HEALTH_SERVICE,
        max_retries=settings.max_retries,
        max_downstream_connections=settings.max_downstream_connections,
        max_in_flight=settings.max_downstream_connections,
        dispatcher_streams=settings.dispatcher_streams,
        dispatcher_connections=len(settings.dispatchers),
        listen_backlog=settings.listen_backlog,
        max_heap_bytes=settings.max_heap_bytes,
        # An ext_proc stream that cannot open is retried on each other replica.
        dispatcher_retries=max(1, len(settings.dispatchers) - 1),
        cluster_type=settings.cluster_type,
        max_request_headers=defaults.GATEWAY_MAX_REQUEST_HEADERS,
        max_request_headers_kb=defaults.GATEWAY_MAX_REQUEST_HEADERS_KB,
    )
