"""The ext_proc gRPC service end to end over a real socket: a grpc.aio server from
``start_grpc_server`` around a Dispatcher on the in-memory fake cluster, and a grpc.aio client
that speaks to it as Envoy does (request headers, then the BUFFERED body with end_of_stream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from bench.harness.noop_extproc import NOOP_ROUTE, FixedRoute
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common import defaults
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.policies import Policy, create_policy
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings
from kairos.extproc.metrics import DispatcherMetrics
from kairos.extproc.server import DRAIN_MODE, BusyLimits, start_grpc_server
from kairos.launcher.tinymodel import build_tiny_model
from tests.unit.test_dispatcher import (
    ADDRESSES,
    LOADED_QUEUE,
    OWNER,
    SIDECAR,
    ExplodingPolicy,
    FakeCluster,
    completion_body,
    make_cluster,
)

OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
COMPLETIONS = "/v1/completions"
GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("extproc-server-model"))
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def models() -> LatencyModels:
    return load_profile()


@dataclass
class Gateway:
    stub: pb_grpc.ExternalProcessorStub
    cluster: FakeCluster
    dispatcher: Dispatcher


GatewayStarter = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def gateway(tokenizer: PromptTokenizer, models: LatencyModels) -> AsyncIterator[GatewayStarter]:
    """Starts ext_proc servers on port 0 around fake clusters; all are stopped afterwards."""
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []
    dispatchers: list[Dispatcher] = []

    async def start(cluster: FakeCluster, policy: Policy | None = None, busy: BusyLimits | None = None) -> Gateway:
        dispatcher = Dispatcher(
            tokenizer,
            policy or create_policy("kairos", models),
            create_policy("pd", models),
            cluster,
            DispatcherMetrics(CollectorRegistry()),
            DispatchSettings(dispatcher_id=OWNER),
        )
        dispatchers.append(dispatcher)
        server, port = await start_grpc_server(dispatcher, "127.0.0.1", 0, busy=busy)
        servers.append(server)
        assert port > 0
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return Gateway(pb_grpc.ExternalProcessorStub(channel), cluster, dispatcher)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(grace=None)
    for dispatcher in dispatchers:
        dispatcher.close()


# ---------------------------------------------------------------------------------------------
# Envoy's side of the stream
# ---------------------------------------------------------------------------------------------
def request_headers(
    method: str,
    path: str,
    *,
    end_of_stream: bool = False,
    extra: Sequence[tuple[str, str]] = (),
    legacy_value: bool = False,
) -> pb.ProcessingRequest:
    """Request headers as Envoy sends them: pseudo-headers first, values in ``raw_value``
    (``value`` when ``legacy_value``, as Envoy versions before raw_value did)."""
    pairs = [
        (":authority", "gateway.local:8080"),
        (":method", method),
        (":path", path),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("x-request-id", "envoy-generated-id-1"),
        *extra,
    ]
    headers = [
        base_pb2.HeaderValue(key=k, value=v) if legacy_value else base_pb2.HeaderValue(key=k, raw_value=v.encode())
        for k, v in pairs
    ]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers), end_of_stream=end_of_stream)
    )


def request_body(body: bytes, *, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def one_message(
    body: bytes,
    *,
    path: str = COMPLETIONS,
    header_count: int = 7,
    header_bytes: int = 180,
    attributes: Sequence[str] = c.HEAD_ATTRIBUTES,
) -> pb.ProcessingRequest:
    """The whole body alone, as Envoy sends it on its one-message route, with the head's facts
    as the attributes it evaluates (only those named in ``attributes``)."""
    values: dict[str, Any] = {
        c.ATTR_METHOD: "POST",
        c.ATTR_PATH: path,
        c.ATTR_REQUEST_ID: "envoy-generated-id-1",
        c.ATTR_HEADER_COUNT: header_count,
        c.ATTR_TOTAL_BYTES: header_bytes + len(body),
        c.ATTR_BODY_BYTES: len(body),
    }
    message = request_body(body)
    message.attributes[c.EXT_PROC_ATTRIBUTES_NAMESPACE].update({k: values[k] for k in attributes})
    return message


async def exchange(stub: pb_grpc.ExternalProcessorStub, messages: Sequence[pb.ProcessingRequest]) -> list[Any]:
    """Send each message and read its answer, as Envoy does; the server must then end the stream
    by itself (the client never half-closes)."""
    call = stub.Process()
    answers: list[Any] = []
    for message in messages:
        await call.write(message)
        answer = await asyncio.wait_for(call.read(), 5)
        assert answer is not grpc.aio.EOF, f"stream ended before answering {message.WhichOneof('request')}"
        answers.append(answer)
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF, "the server kept the stream open"
    assert await call.code() == grpc.StatusCode.OK
    return answers


def metadata_of(answer: pb.ProcessingResponse) -> dict[str, Any]:
    return json_format.MessageToDict(answer.dynamic_metadata)


def reply_headers_of(mutation: pb.HeaderMutation) -> dict[str, str]:
    """The set headers of an immediate reply, checking Envoy's wire rules on each: value in
    raw_value (Envoy ignores ``value`` there) and overwrite-or-add."""
    out: dict[str, str] = {}
    for option in mutation.set_headers:
        assert option.header.value == "", f"{option.header.key} carries its value in `value`, which Envoy ignores"
        assert option.header.raw_value, f"{option.header.key} has no raw_value"
        assert option.append_action == OVERWRITE, f"{option.header.key} is not OVERWRITE_IF_EXISTS_OR_ADD"
        assert option.header.key not in out, f"{option.header.key} is set twice"
        out[option.header.key] = option.header.raw_value.decode()
    return out


# What the gateway's routes add from the answer's metadata (kairos.launcher.envoy_config).
ADDED_BY_THE_ROUTES = {c.H_REQUEST_ID, *c.ROUTING_HEADERS}


def set_headers_of(answer: pb.ProcessingResponse) -> dict[str, str]:
    """The headers a routed answer sets: string values in its routing metadata, each one the
    gateway's routes add (a name outside them would be silently dropped), none as a header
    mutation (Envoy ignores those in a body answer on the one-message route)."""
    phase = answer.WhichOneof("response")
    assert not getattr(answer, phase).response.header_mutation.set_headers
    headers = metadata_of(answer).get(c.ROUTING_METADATA_NAMESPACE, {})
    assert set(headers) <= ADDED_BY_THE_ROUTES, set(headers) - ADDED_BY_THE_ROUTES
    assert all(isinstance(v, str) for v in headers.values())
    return headers


def destination_of(answer: pb.ProcessingResponse) -> dict[str, Any]:
    return metadata_of(answer)[c.ENVOY_LB_NAMESPACE]


def destination(*nodes: str) -> dict[str, Any]:
    return {c.ENVOY_DESTINATION_KEY: ",".join(SIDECAR[n] for n in nodes)}


def assert_empty_headers_answer(answer: pb.ProcessingResponse) -> None:
    assert answer.WhichOneof("response") == "request_headers"
    assert answer.request_headers == pb.HeadersResponse()
    assert not answer.HasField("dynamic_metadata")


# ---------------------------------------------------------------------------------------------
# Routed requests
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutedCase:
    prefill_queue: tuple[int, ...]
    prompt_tokens: int
    route: str
    nodes: tuple[str, ...]  # primary decode node, then the fallback


ROUTED_CASES = [
    pytest.param(RoutedCase((), 4000, "keep", ("d0", "d1")), id="idle cluster keeps, d0 first and d1 as fallback"),
    pytest.param(
        RoutedCase(LOADED_QUEUE, 1000, "deflect", ("d0", "d1")), id="loaded prefill queues deflect to d0 with schedule"
    ),
]


@pytest.mark.parametrize("case", ROUTED_CASES)
async def test_body_answer_carries_headers_and_destination(gateway: GatewayStarter, case: RoutedCase) -> None:
    gw = await gateway(make_cluster(prefill_queue=case.prefill_queue))
    headers_answer, body_answer = await exchange(
        gw.stub, [request_headers("POST", COMPLETIONS), request_body(completion_body(case.prompt_tokens))]
    )

    assert_empty_headers_answer(headers_answer)
    assert body_answer.WhichOneof("response") == "request_body"
    common = body_answer.request_body.response
    assert not common.HasField("body_mutation")
    headers = set_headers_of(body_answer)
    assert list(common.header_mutation.remove_headers) == []
    assert headers[c.H_ROUTE] == case.route
    assert headers[c.H_DECODE_NODE] == case.nodes[0]
    assert headers[c.H_PROMPT_TOKENS] == str(case.prompt_tokens)
    assert headers[c.H_REQUEST_ID] == "envoy-generated-id-1"  # Envoy's id travels on both hops
    if case.route == "keep":
        assert headers[c.H_PREFILL_HOST] == ADDRESSES["p0"].url
        assert c.H_CHUNK_SCHEDULE not in headers
        assert gw.cluster.reservations == []
    else:
        assert sum(int(x) for x in headers[c.H_CHUNK_SCHEDULE].split(",")) == case.prompt_tokens
        assert c.H_STEP_BUDGET_MS in headers
        assert gw.cluster.reservations == [(case.nodes[0], OWNER)]
    assert destination_of(body_answer) == destination(*case.nodes)


@pytest.mark.parametrize("case", ROUTED_CASES)
async def test_a_body_alone_is_routed_in_one_answer_from_its_attributes(
    gateway: GatewayStarter, case: RoutedCase
) -> None:
    """Envoy's one-message route: no headers message, the head's facts as the body's attributes,
    and the same answer as after a headers message."""
    gw = await gateway(make_cluster(prefill_queue=case.prefill_queue))
    (answer,) = await exchange(gw.stub, [one_message(completion_body(case.prompt_tokens))])

    assert answer.WhichOneof("response") == "request_body"
    headers = set_headers_of(answer)
    assert list(answer.request_body.response.header_mutation.remove_headers) == []
    assert headers[c.H_ROUTE] == case.route
    assert headers[c.H_PROMPT_TOKENS] == str(case.prompt_tokens)
    assert headers[c.H_REQUEST_ID] == "envoy-generated-id-1"
    assert destination_of(answer) == destination(*case.nodes)


async def test_a_body_alone_whose_head_leaves_no_room_is_a_431(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    for count, size in ((91, 200), (20, 60 * 1024 - 8 * 1024 + 1)):
        (answer,) = await exchange(gw.stub, [one_message(completion_body(100), header_count=count, header_bytes=size)])
        assert answer.immediate_response.status.code == 431, (count, size)
    (answer,) = await exchange(gw.stub, [one_message(completion_body(100), header_count=90, header_bytes=52 * 1024)])
    assert answer.WhichOneof("response") == "request_body"


async def test_a_body_without_its_attributes_is_a_500_not_a_guess(
    gateway: GatewayStarter, caplog: pytest.LogCaptureFixture
) -> None:
    """An Envoy config of another version (no attributes, or some missing): never routed on an
    empty path or method."""
    gw = await gateway(make_cluster())
    for attributes in ((), c.HEAD_ATTRIBUTES[:-1]):
        (answer,) = await exchange(gw.stub, [one_message(completion_body(100), attributes=attributes)])
        assert answer.immediate_response.status.code == 500
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "internal_error"
    assert "without its head's attributes" in caplog.text
    assert gw.cluster.recorded == []


async def test_streamed_body_chunks_are_acknowledged_and_joined(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    body = completion_body(4000)
    cut = len(body) // 3
    answers = await exchange(
        gw.stub,
        [
            request_headers("POST", COMPLETIONS),
            request_body(body[:cut], end_of_stream=False),
            request_body(body[cut : 2 * cut], end_of_stream=False),
            request_body(body[2 * cut :]),
        ],
    )

    assert_empty_headers_answer(answers[0])
    for partial in answers[1:3]:
        assert partial.WhichOneof("response") == "request_body"
        assert partial.request_body == pb.BodyResponse()
    headers = set_headers_of(answers[3])
    assert headers[c.H_PROMPT_TOKENS] == "4000"
    assert destination_of(answers[3]) == destination("d0", "d1")


async def test_client_kairos_headers_are_removed_on_the_wire(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    spoofed = [("x-kairos-route", "deflect"), ("x-kairos-chunk-schedule", "1,2"), ("x-kairos-debug", "1")]
    _, body_answer = await exchange(
        gw.stub, [request_headers("POST", COMPLETIONS, extra=spoofed), request_body(completion_body(4000))]
    )

    mutation = body_answer.request_body.response.header_mutation
    assert sorted(mutation.remove_headers) == ["x-kairos-chunk-schedule", "x-kairos-debug"]
    assert set_headers_of(body_answer)[c.H_ROUTE] == "keep"


async def test_headers_sent_in_the_legacy_value_field_are_read(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    _, body_answer = await exchange(
        gw.stub, [request_headers("POST", COMPLETIONS, legacy_value=True), request_body(completion_body(4000))]
    )
    headers = set_headers_of(body_answer)
    assert headers[c.H_ROUTE] == "keep"
    assert headers[c.H_REQUEST_ID] == "envoy-generated-id-1"


async def test_a_get_is_answered_at_the_headers_message(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    (answer,) = await exchange(
        gw.stub, [request_headers("GET", "/v1/models", end_of_stream=True, extra=[("x-kairos-route", "keep")])]
    )

    assert answer.WhichOneof("response") == "request_headers"
    mutation = answer.request_headers.response.header_mutation
    assert list(mutation.remove_headers) == ["x-kairos-route"]
    assert set_headers_of(answer) == {}
    assert destination_of(answer) == destination("d0", "d1")
    assert gw.cluster.recorded == []


async def test_a_get_with_nothing_to_change_is_still_a_headers_answer(gateway: GatewayStarter) -> None:
    """No header to set or remove: the answer still names its phase (Envoy drops a stream whose
    answer does not), with the upstream in its metadata."""
    gw = await gateway(make_cluster())
    (answer,) = await exchange(gw.stub, [request_headers("GET", "/v1/models", end_of_stream=True)])

    assert answer.WhichOneof("response") == "request_headers"
    assert answer.request_headers.response.HasField("header_mutation")
    assert destination_of(answer) == destination("d0", "d1")


async def test_a_5_mb_body_is_accepted(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    size = 5 * 1024 * 1024
    assert size > GRPC_DEFAULT_MAX_MESSAGE
    _, body_answer = await exchange(
        gw.stub, [request_headers("POST", COMPLETIONS), request_body(completion_body(4000, size=size))]
    )

    assert body_answer.WhichOneof("response") == "request_body"
    headers = set_headers_of(body_answer)
    assert headers[c.H_PROMPT_TOKENS] == "4000"
    assert destination_of(body_answer) == destination("d0", "d1")


async def test_concurrent_streams_are_each_answered(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())
    prompts = [3000, 3500, 4000, 4500, 5000]
    results = await asyncio.gather(
        *(exchange(gw.stub, [request_headers("POST", COMPLETIONS), request_body(completion_body(n))]) for n in prompts)
    )
    counted = [set_headers_of(body)[c.H_PROMPT_TOKENS] for _, body in results]
    assert counted == [str(n) for n in prompts]
    assert sorted(d.prompt_tokens for d, _ in gw.cluster.recorded) == prompts


# ---------------------------------------------------------------------------------------------
# A dispatcher too busy to decide in time sheds before parsing (BusyLimits)
# ---------------------------------------------------------------------------------------------
def assert_busy_429(answer: pb.ProcessingResponse) -> None:
    reply = answer.immediate_response
    assert reply.status.code == 429
    assert reply_headers_of(reply.headers) == {"content-type": "application/json", "retry-after": "1"}
    error = json.loads(reply.body)["error"]
    assert (error["code"], error["type"]) == ("overloaded", "rate_limit_error")
    assert "dispatcher is busy" in error["message"]
    assert metadata_of(answer) == {"kairos": {"own_reply": True}}


def shed_count(gw: Gateway, reason: str) -> float:
    return gw.dispatcher.metrics.shed.labels(reason=reason)._value.get()


async def test_a_request_past_the_open_streams_bound_gets_a_429_before_it_is_parsed(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster(), busy=BusyLimits(max_open_streams=1))
    held = gw.stub.Process()  # one stream open (its body still to come): the bound is reached
    await held.write(request_headers("POST", COMPLETIONS))
    assert_empty_headers_answer(await asyncio.wait_for(held.read(), 5))

    # Not JSON: parsed, it would be a 400; the shed answers first.
    (answer,) = await exchange(gw.stub, [one_message(b"{not json")])
    assert_busy_429(answer)
    assert "requests being decided" in json.loads(answer.immediate_response.body)["error"]["message"]
    assert shed_count(gw, "open_streams") == 1
    assert gw.cluster.recorded == []

    # That stream closed, the one held open is alone again: decided as usual.
    await held.write(request_body(completion_body(4000)))
    routed = await asyncio.wait_for(held.read(), 5)
    assert set_headers_of(routed)[c.H_PROMPT_TOKENS] == "4000"
    assert await asyncio.wait_for(held.read(), 5) is grpc.aio.EOF
    assert shed_count(gw, "open_streams") == 1


async def test_without_busy_limits_every_request_is_decided(gateway: GatewayStarter) -> None:
    gw = await gateway(make_cluster())  # busy=None: kairos dispatcher --admission off
    held = gw.stub.Process()
    await held.write(request_headers("POST", COMPLETIONS))
    assert_empty_headers_answer(await asyncio.wait_for(held.read(), 5))
    (answer,) = await exchange(gw.stub, [one_message(completion_body(4000))])  # two open, none shed
    assert set_headers_of(answer)[c.H_PROMPT_TOKENS] == "4000"
    held.cancel()


# ---------------------------------------------------------------------------------------------
# Rejected requests: Envoy answers the client directly
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RejectCase:
    cluster: dict[str, Any]
    exploding: bool
    messages: tuple[pb.ProcessingRequest, ...]
    status: int
    code: str


REJECT_CASES = [
    pytest.param(
        RejectCase(
            {}, False, (request_headers("POST", COMPLETIONS), request_body(b"{not json")), 400, "invalid_request"
        ),
        id="malformed JSON body is an immediate 400",
    ),
    pytest.param(
        RejectCase(
            {}, False, (request_headers("POST", COMPLETIONS), request_body(b'{"prompt": ""}')), 400, "invalid_request"
        ),
        id="empty prompt is an immediate 400",
    ),
    pytest.param(
        RejectCase({}, False, (request_headers("POST", "/v1/embeddings"),), 404, "not_found"),
        id="unknown POST path is a 404 at the headers message, before its body",
    ),
    pytest.param(
        RejectCase({}, False, (request_headers("CONNECT", ""),), 404, "not_found"),
        id="a CONNECT, whose tunnel body never ends, is a 404 at the headers message",
    ),
    pytest.param(
        RejectCase(
            {},
            False,
            (
                request_headers(
                    "POST", COMPLETIONS, extra=[("content-length", str(defaults.REFUSED_BODY_DRAIN_BYTES + 1))]
                ),
            ),
            413,
            "payload_too_large",
        ),
        id="a Content-Length past the drain bound is a 413 at the headers message",
    ),
    pytest.param(
        RejectCase(
            {"decode": False},
            False,
            (request_headers("GET", "/v1/models", end_of_stream=True),),
            503,
            "no_healthy_node",
        ),
        id="GET with no decode node is an immediate 503 at the headers message",
    ),
    pytest.param(
        RejectCase(
            {}, True, (request_headers("POST", COMPLETIONS), request_body(completion_body(100))), 500, "internal_error"
        ),
        id="a bug in the policy is an immediate generic 500",
    ),
]


@pytest.mark.parametrize("case", REJECT_CASES)
async def test_rejections_are_immediate_json_responses(gateway: GatewayStarter, case: RejectCase) -> None:
    gw = await gateway(make_cluster(**case.cluster), policy=ExplodingPolicy() if case.exploding else None)
    answers = await exchange(gw.stub, case.messages)

    for earlier in answers[:-1]:
        assert_empty_headers_answer(earlier)
    answer = answers[-1]
    assert answer.WhichOneof("response") == "immediate_response"
    reply = answer.immediate_response
    assert reply.status.code == case.status
    # A 503 (nothing can take it now) says when to retry; a refusal of the request itself does not.
    retry = {"retry-after": "1"} if case.status == 503 else {}
    assert reply_headers_of(reply.headers) == {"content-type": "application/json", **retry}
    error = json.loads(reply.body)["error"]
    assert error["code"] == case.code
    assert set(error) == {"message", "type", "param", "code"}
    assert reply.details == f"kairos_{case.code}"
    assert metadata_of(answer) == {"kairos": {"own_reply": True}}
    assert gw.cluster.recorded == []


# ---------------------------------------------------------------------------------------------
# A request refused from its head while its body is coming: the body is dropped, then answered
# ---------------------------------------------------------------------------------------------
OVER_LIMIT = str(defaults.MAX_REQUEST_BODY_BYTES + 1)


def assert_refusal(answer: pb.ProcessingResponse, status: int, code: str) -> None:
    assert answer.WhichOneof("response") == "immediate_response", answer
    assert answer.immediate_response.status.code == status
    assert json.loads(answer.immediate_response.body)["error"]["code"] == code
    assert metadata_of(answer) == {"kairos": {"own_reply": True}}


@pytest.mark.parametrize(
    ("method", "extra", "status", "code"),
    [
        pytest.param("POST", [("content-length", OVER_LIMIT)], 413, "payload_too_large", id="Content-Length over"),
        pytest.param(
            "POST",
            [("content-length", str(defaults.REFUSED_BODY_DRAIN_BYTES))],
            413,
            "payload_too_large",
            id="Content-Length at the drain bound",
        ),
        pytest.param(
            "POST",
            [("content-length", "100"), ("content-encoding", "gzip")],
            415,
            "unsupported_content_encoding",
            id="compressed body",
        ),
        pytest.param("PUT", [("content-length", "100")], 405, "method_not_allowed", id="unserved method"),
    ],
)
async def test_a_body_refused_from_its_head_is_dropped_chunk_by_chunk_and_answered_at_its_end(
    gateway: GatewayStarter, method: str, extra: list[tuple[str, str]], status: int, code: str
) -> None:
    """Envoy would close the connection under a client still writing if answered before the
    body's end: the headers answer switches the body to streamed (exactly the mode the gateway's
    config allows), every chunk is answered with an order to drop it, the last with the refusal."""
    gw = await gateway(make_cluster())
    answers = await exchange(
        gw.stub,
        [
            request_headers(method, COMPLETIONS, extra=extra),
            request_body(b"x" * 65536, end_of_stream=False),
            request_body(b"x" * 65536, end_of_stream=False),
            request_body(b"", end_of_stream=True),
        ],
    )
    headers_answer = answers[0]
    assert headers_answer.WhichOneof("response") == "request_headers"
    assert headers_answer.request_headers == pb.HeadersResponse()
    assert headers_answer.mode_override == DRAIN_MODE
    for dropped in answers[1:3]:
        assert dropped.WhichOneof("response") == "request_body"
        assert dropped.request_body.response.body_mutation.clear_body
    assert_refusal(answers[3], status, code)
    assert gw.cluster.recorded == []


async def test_a_dropped_body_that_ends_in_trailers_is_answered_at_them(gateway: GatewayStarter) -> None:
    """Trailers are the request's end too: answered there, never left for the buffer filter to
    pass the emptied request on."""
    gw = await gateway(make_cluster())
    answers = await exchange(
        gw.stub,
        [
            request_headers("POST", COMPLETIONS, extra=[("content-length", OVER_LIMIT)]),
            request_body(b"x" * 1024, end_of_stream=False),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        ],
    )
    assert answers[0].mode_override == DRAIN_MODE
    assert_refusal(answers[2], 413, "payload_too_large")


async def test_a_client_that_leaves_mid_drop_ends_the_stream_quietly(
    gateway: GatewayStarter, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await gateway(make_cluster())
    call = gw.stub.Process()
    await call.write(request_headers("POST", COMPLETIONS, extra=[("content-length", OVER_LIMIT)]))
    assert (await asyncio.wait_for(call.read(), 5)).mode_override == DRAIN_MODE
    await call.write(request_body(b"x" * 1024, end_of_stream=False))
    assert (await asyncio.wait_for(call.read(), 5)).request_body.response.body_mutation.clear_body
    await call.done_writing()  # Envoy closes its side: the client is gone
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("extra", "status", "code"),
    [
        pytest.param(
            [("content-length", str(defaults.REFUSED_BODY_DRAIN_BYTES + 1))],
            413,
            "payload_too_large",
            id="past the drain bound",
        ),
        pytest.param(
            [("transfer-encoding", "chunked"), ("content-encoding", "gzip")],
            415,
            "unsupported_content_encoding",
            id="no declared length",
        ),
    ],
)
async def test_a_refused_body_not_known_to_be_within_the_bound_is_answered_at_once(
    gateway: GatewayStarter, extra: list[tuple[str, str]], status: int, code: str
) -> None:
    gw = await gateway(make_cluster())
    (answer,) = await exchange(gw.stub, [request_headers("POST", COMPLETIONS, extra=extra)])
    assert not answer.HasField("mode_override")
    assert_refusal(answer, status, code)


def test_the_gateway_allows_the_dispatcher_exactly_its_drop_mode() -> None:
    """The mode override the server sends is the one the rendered ext_proc filter allows (an
    override outside allowed_override_modes is ignored by Envoy: the body would be buffered and
    the refusal would never come)."""
    import yaml

    from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config

    config = yaml.safe_load(render_envoy_config(EnvoySettings(sidecars=("127.0.0.1:8201",))))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = (f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["allow_mode_override"] is True
    allowed = [json_format.ParseDict(mode, type(DRAIN_MODE)()) for mode in ext_proc["allowed_override_modes"]]
    assert allowed == [DRAIN_MODE]


# ---------------------------------------------------------------------------------------------
# The benchmark's no-op ext_proc server (the transport floor in bench/micro/gateway_overhead.py)
# ---------------------------------------------------------------------------------------------
async def test_the_no_op_server_routes_every_request_to_its_fixed_upstream() -> None:
    """Same service and answer encoding as the real dispatcher's, with nothing decided: the
    route header and destination are the fixed ones, for a body and for a GET alike."""
    server, port = await start_grpc_server(FixedRoute("127.0.0.1:9"), "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            posted = await exchange(stub, [request_headers("POST", COMPLETIONS), request_body(b"not even JSON")])
            got = await exchange(stub, [request_headers("GET", "/v1/models", end_of_stream=True)])
    finally:
        await server.stop(grace=None)
    assert_empty_headers_answer(posted[0])
    for answer, phase in ((posted[1], "request_body"), (got[0], "request_headers")):
        assert answer.WhichOneof("response") == phase
        assert set_headers_of(answer) == {c.H_ROUTE: NOOP_ROUTE}
        assert destination_of(answer) == {c.ENVOY_DESTINATION_KEY: "127.0.0.1:9"}


# ---------------------------------------------------------------------------------------------
# grpc.health.v1, which Envoy's active health checks of the dispatcher cluster call
# ---------------------------------------------------------------------------------------------
async def test_the_server_answers_grpc_health_checks_and_says_not_serving_once_it_drains() -> None:
    health = health_aio.HealthServicer()
    server, port = await start_grpc_server(FixedRoute("127.0.0.1:9"), "127.0.0.1", 0, health)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

            serving = health_pb2.HealthCheckResponse.SERVING
            # The name Envoy asks about (the contract) is the ext_proc service's own.
            assert pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name == c.EXT_PROC_HEALTH_SERVICE
            assert await status(c.EXT_PROC_HEALTH_SERVICE) == serving
            assert await status("") == serving  # the whole server, as grpc_health_probe asks
            await health.enter_graceful_shutdown()  # what the dispatcher does first when it stops
            assert await status(c.EXT_PROC_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(grace=None)
