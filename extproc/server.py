"""The Envoy ext_proc gRPC service: translates between Envoy's processing stream and the
:class:`~kairos.extproc.dispatcher.Dispatcher`.

Per HTTP request Envoy opens one ``Process`` stream. On its one-message route (a plain inference
request, ``envoy/envoy.yaml.j2``) it sends the whole body alone, the facts of the head we read
coming with it as attributes (``contracts.HEAD_ATTRIBUTES``): one message each way. On any other
route it sends the request headers, then (body mode BUFFERED) the whole body: we answer the
headers message with an empty response, or at once for requests without a body (GETs). Those the
headers alone refuse (an unserved path or method, a body too large or compressed, a head with no
room left for the routing headers) are refused in the answer to the headers when no body follows
or it is longer than we would drop, else at the body's end, once Envoy has streamed it to us and
dropped it (:data:`DRAIN_MODE`): an HTTP/1 client still writing would otherwise get a reset
instead of the answer. Every mutation goes in the last response, as dynamic metadata: the
upstream in ``envoy.lb`` for the override_host load balancer, and the decision headers in
``kairos.headers``, which Envoy's routes add.
Response processing is skipped, so the stream is ended as soon as the last answer is sent
(Envoy would otherwise hold it for the whole SSE response).

A dispatcher with more streams open than it decides within Envoy's message timeout sheds before
it parses (:class:`BusyLimits`): an inference request that finds too many streams open is
answered at once with the admission gate's 429 and Retry-After, counted in
``kairos_dispatcher_shed_total{reason="open_streams"}``; else Envoy would answer it a moment later
with a timeout, after the dispatcher had spent the work. (Envoy sends no gRPC deadline on its
ext_proc streams, so how long one waited is not known here.)

The same server answers the standard gRPC health-checking protocol (``grpc.health.v1``), which
Envoy's active health checks of the dispatcher cluster call: ``SERVING`` for the ext_proc service
while the dispatcher runs, ``NOT_SERVING`` once it starts to stop, so Envoy moves new requests to
another replica before this one closes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.errors import OverloadedError
from kairos.common.http_errors import INTERNAL_CODE, error_json, error_status
from kairos.core.admission import AdmissionLimits
from kairos.extproc.dispatcher import Dispatcher, Rejected, RequestHead, Routed

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # bodies arrive whole (BUFFERED); grpcio's default is 4 MB
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
# "Go on" answers to a message that is not the last one (the same every time: built once).
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
# A request refused from its head with a body to come (see the module doc): the answer to its
# headers switches the body to STREAMED (mode_override; the gateway's ext_proc config allows this
# mode and no other), each chunk is answered with an order to drop it, the last with the refusal.
# Trailers are sent too: the refusal must come before the buffer filter could pass the emptied
# request on.
_MODE = processing_mode_pb2.ProcessingMode
DRAIN_MODE = _MODE(
    request_header_mode=_MODE.SEND,
    request_body_mode=_MODE.STREAMED,
    request_trailer_mode=_MODE.SEND,
    response_header_mode=_MODE.SKIP,
    response_body_mode=_MODE.NONE,
    response_trailer_mode=_MODE.SKIP,
)
_DRAIN_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=DRAIN_MODE)
_DROP_CHUNK = pb.ProcessingResponse(
    request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True)))
)
# A 503 (no node can take the request now, e.g. every decode node over its overload line during a
# spike) says when to retry, as the admission gate's 429 and Envoy's own 503s do.
UNAVAILABLE_RETRY_AFTER_S = AdmissionLimits().retry_after_s
# A body without its head's attributes: the gateway's own misconfiguration, not the client's.
_NO_HEAD = Rejected(
    500,
    error_json(RuntimeError("the gateway's Envoy config does not match its dispatcher")),  # the generic 500
    INTERNAL_CODE,
)


def _headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _head_of_attributes(msg: pb.ProcessingRequest) -> RequestHead | None:
    """The head of a request Envoy sent as its body alone (the one-message route); None when
    the attributes are not there (an Envoy config rendered for another version)."""
    if c.EXT_PROC_ATTRIBUTES_NAMESPACE not in msg.attributes:
        return None
    fields = msg.attributes[c.EXT_PROC_ATTRIBUTES_NAMESPACE].fields
    if any(name not in fields for name in c.HEAD_ATTRIBUTES):
        return None
    body_bytes = int(fields[c.ATTR_BODY_BYTES].number_value)
    return RequestHead(
        method=fields[c.ATTR_METHOD].string_value,
        path=fields[c.ATTR_PATH].string_value,
        request_id=fields[c.ATTR_REQUEST_ID].string_value,
        content_length=str(body_bytes),
        header_count=int(fields[c.ATTR_HEADER_COUNT].number_value),
        header_bytes=int(fields[c.ATTR_TOTAL_BYTES].number_value) - body_bytes,
    )


def _routed_response(routed: Routed, phase: str) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    answer = response.request_headers if phase == "headers" else response.request_body
    # Present, with its parents, even with nothing to remove: the answer must name its phase.
    answer.response.header_mutation.SetInParent()
    answer.response.header_mutation.remove_headers.extend(routed.remove_headers)
    # The headers to set go as metadata, which the gateway's routes add as headers: on the
    # one-message route Envoy applies no header mutation from a body answer (the head was not
    # sent), and one encoding serves both routes.
    metadata = {c.ENVOY_LB_NAMESPACE: {c.ENVOY_DESTINATION_KEY: ",".join(routed.destinations)}}
    if routed.set_headers:
        metadata[c.ROUTING_METADATA_NAMESPACE] = dict(routed.set_headers)
    response.dynamic_metadata.update(metadata)
    return response


def _rejected_response(rejected: Rejected) -> pb.ProcessingResponse:
    set_headers = [("content-type", b"application/json")]
    retry_after_s = rejected.retry_after_s
    if retry_after_s is None and rejected.status == 503:
        retry_after_s = UNAVAILABLE_RETRY_AFTER_S
    if retry_after_s is not None:
        set_headers.append(("retry-after", str(retry_after_s).encode()))
    headers = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)
            for key, value in set_headers
        ]
    )
    marker = struct_pb2.Struct()
    marker.update({"kairos": {"own_reply": True}})  # Envoy's JSON error formatter leaves it alone
    return pb.ProcessingResponse(
        dynamic_metadata=marker,
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=rejected.status),
            headers=headers,
            body=rejected.body,
            details=f"kairos_{rejected.code}",
        ),
    )


def _drains(head: RequestHead) -> bool:
    """Whether a refused request's body is read (and dropped) before its answer: one of a declared
    length within defaults.REFUSED_BODY_DRAIN_BYTES. A longer one, or one of no declared length (a
    chunked upload, a CONNECT's tunnel that never ends), is answered at once."""
    declared = head.content_length
    return declared.isascii() and declared.isdigit() and int(declared) <= defaults.REFUSED_BODY_DRAIN_BYTES


async def _drain(context: grpc.aio.ServicerContext) -> bool:
    """Drop a refused request's streamed body chunk by chunk (see DRAIN_MODE). True at its end,
    the message the refusal answers; False when Envoy closed the stream first (the client left,
    or its body stalled past Envoy's request_timeout)."""
    while True:
        msg = await context.read()
        if msg is grpc.aio.EOF:
            return False
        kind = msg.WhichOneof("request")
        if kind == "request_trailers" or (kind == "request_body" and msg.request_body.end_of_stream):
            return True
        if kind != "request_body":  # nothing else is subscribed: answer with the refusal now
            log.warning("unexpected ext_proc message %s while dropping a refused body", kind)
            return True
        await context.write(_DROP_CHUNK)


@dataclass(frozen=True, slots=True)
class BusyLimits:
    """When the dispatcher has more to decide than it can in time (defaults say why)."""

    max_open_streams: int = defaults.DISPATCHER_MAX_OPEN_STREAMS
    retry_after_s: int = AdmissionLimits().retry_after_s


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, dispatcher: Dispatcher, busy: BusyLimits | None = None) -> None:
        self.dispatcher = dispatcher
        self.busy = busy  # None: decide every request however late
        self._open = 0  # Process streams open now

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        self._open += 1
        try:
            await self._process(context)
        finally:
            self._open -= 1

    def _shed_busy(self) -> Rejected | None:
        """The 429 for a request the dispatcher is too busy to decide in time, else None."""
        busy = self.busy
        if busy is None or self._open <= busy.max_open_streams:
            return None
        self.dispatcher.metrics.shed.labels(reason="open_streams").inc()
        exc = OverloadedError(
            f"the gateway is at capacity (its dispatcher is busy: {self._open} requests being decided); "
            f"retry after {busy.retry_after_s} s",
            busy.retry_after_s,
        )
        return Rejected(error_status(exc), error_json(exc), exc.code, exc.retry_after_s)

    async def _process(self, context: grpc.aio.ServicerContext) -> None:
        # context.read()/write() rather than an async generator over request_iterator: grpc.aio
        # wraps a generator in more machinery per message (about 0.1 ms of the no-op ext_proc's
        # ~1.2 ms per request on this machine, measured with both servers behind one Envoy config).
        head: RequestHead | None = None
        body = bytearray()
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                headers = _headers_of(msg.request_headers)
                head = RequestHead.of(headers.get(":method", ""), headers.get(":path", ""), headers)
                if msg.request_headers.end_of_stream:
                    await context.write(self._answer(await self.dispatcher.route(head, None), "headers"))
                    return
                refused = self.dispatcher.check_headers(head)
                if refused is not None:
                    if _drains(head):
                        await context.write(_DRAIN_HEADERS)
                        if not await _drain(context):
                            return
                    await context.write(_rejected_response(refused))
                    return
                await context.write(_CONTINUE_HEADERS)
            elif kind == "request_body":
                if head is None:  # the one-message route: no headers message comes
                    head = _head_of_attributes(msg)
                    if head is None:
                        log.error(
                            "a request body came without its head's attributes (%s; it had %s): render "
                            "Envoy's config for this version of the dispatcher",
                            ", ".join(c.HEAD_ATTRIBUTES),
                            {ns: list(v.fields) for ns, v in msg.attributes.items()},
                        )
                        await context.write(_rejected_response(_NO_HEAD))
                        return
                if msg.request_body.end_of_stream:
                    busy = self._shed_busy()
                    if busy is not None:  # before any parsing: the work it saves is the point
                        await context.write(_rejected_response(busy))
                        return
                    # BUFFERED mode sends the whole body in this one message: no copy then.
                    whole = bytes(body + msg.request_body.body) if body else msg.request_body.body
                    await context.write(self._answer(await self.dispatcher.route(head, whole), "body"))
                    return
                body += msg.request_body.body
                await context.write(_CONTINUE_BODY)
            else:
                # Only request headers and body are subscribed; anything else is passed on untouched.
                log.warning("unexpected ext_proc message %s", kind)
                return

    @staticmethod
    def _answer(result: Routed | Rejected, phase: str) -> pb.ProcessingResponse:
        if isinstance(result, Rejected):
            return _rejected_response(result)
        return _routed_response(result, phase)


async def start_grpc_server(
    dispatcher: Dispatcher,
    host: str,
    port: int,
    health: health_aio.HealthServicer | None = None,
    busy: BusyLimits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc service and the gRPC health service beside it (``health``, or one of
    its own that says SERVING); returns the server and the bound port (``port=0`` picks one).
    ``busy``: shed requests the dispatcher cannot decide in time (None: never)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(dispatcher, busy), server)
    health = health or health_aio.HealthServicer()
    await health.set(c.EXT_PROC_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the ext_proc gRPC server to {host}:{port}")
    await server.start()
    return server, bound
