"""The gateway's public port as an adversary sees it, through real Envoy to the emulated
cluster: only the public API is served, Envoy's own errors are OpenAI-shaped, undecodable bodies
are 4xx, HTTP/1 oddities on a raw socket get clean answers, and a property-based fuzz finds no
5xx and no hang."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.contracts import Role
from kairos.launcher.envoy_config import EnvoySettings
from kairos.launcher.local_cluster import LocalCluster
from kairos.launcher.processes import free_port
from kairos.launcher.servers import gateway_process
from tests.e2e.conftest import http, post_json, text_of
from tests.waiting import wait_until

MODEL = "kairos-tiny-llama"
COMPLETION = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()


def assert_openai_error(
    status: int, raw: bytes, expected: int, code: str | None = None, *, vllm_code: bool = False
) -> dict[str, Any]:
    """``raw`` is an OpenAI error body: a non-empty string message, code a string or null (or,
    with ``vllm_code``, the integer status vLLM puts there in the errors a node answers)."""
    assert status == expected, raw[:300]
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] is None or isinstance(error["code"], str) or (vllm_code and error["code"] == status), error
    if code is not None:
        assert error["code"] == code, error
    return error


def still_serving(cluster: LocalCluster, url: str | None = None) -> None:
    status, _, body = post_json(
        f"{url or cluster.gateway_url}/v1/completions", {"model": MODEL, "prompt": "still there?", "max_tokens": 1}
    )
    assert status == 200, body


# ---------------------------------------------------------------------------------------------
# The public API only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", c.STATE_PATH),
        ("GET", c.STEPS_PATH),
        ("GET", "/metrics"),
        ("GET", "/kairos/metrics"),
        ("PUT", "/kairos/kv/pull"),
        ("POST", "/kairos/kv/pull"),
        ("GET", "/nodes"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/models/"),
        ("GET", "/v1/../kairos/state"),
        ("GET", "//health"),
    ],
)
def test_anything_but_the_public_api_is_a_json_404(cluster: LocalCluster, method: str, path: str) -> None:
    status, headers, raw = http(method, f"{cluster.gateway_url}{path}", b"{}" if method in ("PUT", "POST") else None)
    error = assert_openai_error(status, raw, 404, "not_found")
    assert "/v1/completions" in error["message"]  # says what is served
    assert headers["content-type"].startswith("application/json")


def test_the_public_api_is_served(cluster: LocalCluster, tokenizer: PromptTokenizer) -> None:
    status, _, raw = http("GET", f"{cluster.gateway_url}/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL
    status, _, raw = http("GET", f"{cluster.gateway_url}/health")
    assert status == 200
    status, _, out = post_json(f"{cluster.gateway_url}/tokenize", {"model": MODEL, "prompt": "Hello, Kairos"})
    assert status == 200 and out["tokens"] == tokenizer.encode("Hello, Kairos")
    assert out["count"] == tokenizer.count_completion_prompt("Hello, Kairos")
    status, _, back = post_json(f"{cluster.gateway_url}/detokenize", {"model": MODEL, "tokens": out["tokens"][1:]})
    assert status == 200 and back == {"prompt": "Hello, Kairos"}
    status, _, raw = http("GET", f"{cluster.gateway_url}/version")
    assert status == 200 and set(json.loads(raw)) == {"version"}


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/models"), ("GET", "/tokenize")],
)
def test_a_public_path_with_another_method_is_a_405(cluster: LocalCluster, method: str, path: str) -> None:
    status, _, raw = http(method, f"{cluster.gateway_url}{path}", b"{}" if method != "GET" else None)
    assert_openai_error(status, raw, 405, "method_not_allowed")


# ---------------------------------------------------------------------------------------------
# Bodies that cannot be read as sent
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        pytest.param(
            COMPLETION, {"content-encoding": "gzip"}, 415, "unsupported_content_encoding", id="plain body labelled gzip"
        ),
        pytest.param(
            gzip.compress(COMPLETION),
            {"content-encoding": "gzip"},
            415,
            "unsupported_content_encoding",
            id="real gzip body",
        ),
        pytest.param(COMPLETION, {"content-encoding": "br"}, 415, "unsupported_content_encoding", id="br"),
        pytest.param(COMPLETION, {"content-encoding": "deflate"}, 415, "unsupported_content_encoding", id="deflate"),
        pytest.param(
            b'{"model": "kairos-tiny-llama", "prompt": "a \xed\xa0\x80 b", "max_tokens": 1}',
            {},
            400,
            "invalid_request",
            id="raw surrogate bytes in the prompt",
        ),
        pytest.param(
            b'{"model": "kairos-tiny-llama", "prompt": "a", "max_tokens": 1, "user": "\xed\xb2\x80"}',
            {},
            400,
            "invalid_request",
            id="raw surrogate bytes in another field",
        ),
    ],
)
def test_undecodable_bodies_are_4xx(
    cluster: LocalCluster, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    got, _, raw = http(
        "POST", f"{cluster.gateway_url}/v1/completions", body, {"content-type": "application/json", **headers}
    )
    assert_openai_error(got, raw, status, code)


def test_chat_with_raw_surrogate_bytes_is_a_400(cluster: LocalCluster) -> None:
    body = b'{"model": "kairos-tiny-llama", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    status, _, raw = http(
        "POST", f"{cluster.gateway_url}/v1/chat/completions", body, {"content-type": "application/json"}
    )
    assert_openai_error(status, raw, 400, "invalid_request")


def test_near_limit_bodies_are_refused_and_small_requests_beside_them_served(cluster: LocalCluster) -> None:
    """Three 7 MB prompts (about 3 million tokens each, the body limit is 8 MiB) at once with
    small requests: each big one is a 400 once counted past the context, never Envoy's 504,
    and every small one is served."""
    big = json.dumps(
        {"model": MODEL, "prompt": "the quick brown fox jumps over a lazy dog " * 174_000, "max_tokens": 1}
    ).encode()
    assert 7_000_000 < len(big) < 8 * 1024 * 1024
    results: dict[str, tuple[int, bytes]] = {}

    def send(name: str, body: bytes) -> None:
        status, _, raw = http(
            "POST", f"{cluster.gateway_url}/v1/completions", body, {"content-type": "application/json"}, timeout=120
        )
        results[name] = (status, raw)

    threads = [threading.Thread(target=send, args=(f"big{i}", big)) for i in range(3)]
    threads += [threading.Thread(target=send, args=(f"small{i}", COMPLETION)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == len(threads)
    for name, (status, raw) in results.items():
        if name.startswith("big"):
            error = assert_openai_error(status, raw, 400, "invalid_request")
            assert "more than 32768 input tokens" in error["message"]
        else:
            assert status == 200, raw[:300]


# ---------------------------------------------------------------------------------------------
# Raw sockets: HTTP/1 as a careless or hostile client speaks it
# ---------------------------------------------------------------------------------------------
def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response from ``sock`` (Content-Length bodies only; Envoy's local replies and
    the nodes' JSON have one); what follows it stays in ``buf``."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response head: {bytes(buf)!r}")
        buf += chunk
    head, _, _ = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    start = len(head) + 4
    while len(buf) < start + length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        buf += chunk
    body = bytes(buf[start : start + length])
    del buf[: start + length]
    return status, headers, body


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    return sock


def _request(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_content_length_with_transfer_encoding_is_a_clean_400(cluster: LocalCluster) -> None:
    body = b'{"model": "kairos-tiny-llama", "prompt": "x", "max_tokens": 1}'
    smuggle = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(smuggle)
        status, headers, raw = _read_response(sock, bytearray())
    assert_openai_error(status, raw, 400)
    assert headers["content-type"].startswith("application/json")
    still_serving(cluster)


def test_a_body_over_envoys_buffer_is_a_json_413(cluster: LocalCluster) -> None:
    body = b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}'  # over the 16 MiB buffer limit
    chunked = (  # no Content-Length: the dispatcher cannot refuse it before Envoy has buffered it
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    )
    with _connect(_port(cluster.gateway_url)) as sock:
        with contextlib.suppress(OSError):  # Envoy may answer and close before taking it all
            sock.sendall(chunked)
        status, _, raw = _read_response(sock, bytearray())
    error = assert_openai_error(status, raw, 413, "payload_too_large")
    assert "buffer limit" in error["message"]
    still_serving(cluster)


def test_a_content_length_past_the_drain_bound_is_a_413_before_the_body_is_sent(cluster: LocalCluster) -> None:
    """The dispatcher refuses at the request's headers a body it would not drop whole: the
    client hears at once, without uploading (or Envoy buffering) the 20 MB it announced."""
    assert defaults.REFUSED_BODY_DRAIN_BYTES < 20_000_000
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.settimeout(10)  # waiting for the body would take Envoy's 60 s request timeout
        sock.sendall(head + b"Content-Length: 20000000\r\n\r\n" + b'{"prompt": "')
        status, headers, raw = _read_response(sock, bytearray())
    error = assert_openai_error(status, raw, 413, "payload_too_large")
    assert "20000000 bytes" in error["message"]
    assert headers["content-type"].startswith("application/json")
    still_serving(cluster)


# A client that writes its whole over-limit body before it reads: the dispatcher refuses it from
# its head, and has Envoy read and drop the body before the answer (kairos.extproc.server.DRAIN_MODE).
# Answered mid-body, Envoy would stop reading and close the connection a moment later (1 s), and a
# client still writing would get a reset, not the 413: a fast writer sometimes, a slow one always.
OVER_LIMIT_BODY = json.dumps({"model": MODEL, "prompt": "x" * (9 * 1024 * 1024)}).encode()
OVER_LIMIT_WRITE = 256 * 1024


def _write_whole_then_read(port: int, pause_s: float) -> int | str:
    """One client: the head, then the whole body, in one sendall (``pause_s`` 0, as http.client
    sends a request) or in 256 KiB writes ``pause_s`` apart (a slow client's pace, not a wait for
    anything), and only then the answer. Its status, once checked to be the JSON 413; or the
    error that kept the client from it."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n" % len(OVER_LIMIT_BODY)
    try:
        with _connect(port) as sock:
            sock.sendall(head)
            if pause_s == 0:
                sock.sendall(OVER_LIMIT_BODY)
            else:
                for start in range(0, len(OVER_LIMIT_BODY), OVER_LIMIT_WRITE):
                    sock.sendall(OVER_LIMIT_BODY[start : start + OVER_LIMIT_WRITE])
                    time.sleep(pause_s)
            status, headers, raw = _read_response(sock, bytearray())
    except OSError as exc:  # the reset this is about (ECONNRESET, EPIPE)
        return repr(exc)
    assert_openai_error(status, raw, 413, "payload_too_large")
    assert headers["content-type"].startswith("application/json")
    return status


def test_an_over_limit_body_written_whole_at_full_speed_gets_its_json_413_every_time(cluster: LocalCluster) -> None:
    assert defaults.MAX_REQUEST_BODY_BYTES < len(OVER_LIMIT_BODY) <= defaults.REFUSED_BODY_DRAIN_BYTES
    outcomes = Counter(_write_whole_then_read(_port(cluster.gateway_url), 0) for _ in range(100))
    assert outcomes == {413: 100}
    still_serving(cluster)


def test_an_over_limit_body_written_whole_slowly_gets_its_json_413_every_time(cluster: LocalCluster) -> None:
    """256 KiB writes 0.04 s apart: each body takes about 1.5 s to send, longer than Envoy
    waits (1 s) before closing a connection it answered mid-body; 20 clients, 10 at a time."""
    with ThreadPoolExecutor(10) as pool:
        outcomes = Counter(pool.map(lambda _: _write_whole_then_read(_port(cluster.gateway_url), 0.04), range(20)))
    assert outcomes == {413: 20}
    still_serving(cluster)


def test_a_connect_request_is_a_json_404_at_once(cluster: LocalCluster) -> None:
    """A CONNECT's body is a tunnel that never ends: answered from its headers, not after
    Envoy's 60 s request timeout."""
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.settimeout(10)
        sock.sendall(b"CONNECT 127.0.0.1:6379 HTTP/1.1\r\nHost: 127.0.0.1:6379\r\n\r\n")
        status, _, raw = _read_response(sock, bytearray())
    error = assert_openai_error(status, raw, 404, "not_found")
    assert "/v1/completions" in error["message"]
    still_serving(cluster)


def test_a_request_no_route_matches_is_a_json_404_that_says_so(cluster: LocalCluster) -> None:
    """OPTIONS * (an asterisk-form target) matches no route, not even the catch-all: Envoy's own
    404, which has no body to quote, still says what the gateway serves."""
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(b"OPTIONS * HTTP/1.1\r\nHost: gw\r\n\r\n")
        status, _, raw = _read_response(sock, bytearray())
    error = assert_openai_error(status, raw, 404, "not_found")
    assert "/v1/completions" in error["message"]


def _read_to_close(sock: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """An HTTP/1.0 response, its body delimited by the connection's close: status line, headers, body."""
    raw = bytearray()
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], headers, body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_http_1_0_clients_are_served(cluster: LocalCluster, stream: bool) -> None:
    """As vLLM's server serves them (ApacheBench speaks HTTP/1.0), not refused with a 426; no
    Host header needed, and a stream ends with the connection."""
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}).encode()
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        status_line, headers, raw = _read_to_close(sock)
    assert status_line.split()[1] == "200", (status_line, raw[:300])
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and len(events) == 4, raw[:600]
    else:
        assert json.loads(raw)["usage"]["completion_tokens"] == 3


def test_pipelined_requests_are_answered_in_order(cluster: LocalCluster) -> None:
    good = _request("/v1/completions", COMPLETION)
    models = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(good + models + good)  # one write: three requests back to back
        buf = bytearray()
        answers = [_read_response(sock, buf) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 200]
    assert json.loads(answers[1][2])["data"][0]["id"] == MODEL
    assert [json.loads(answers[i][2])["usage"]["completion_tokens"] for i in (0, 2)] == [1, 1]


def test_pipelined_requests_behind_an_error_are_answered_right_or_left_to_resend(cluster: LocalCluster) -> None:
    """Envoy closes an HTTP/1 connection after some of its own replies to pipelined requests (a
    404 behind another request; an ext_proc rejection, announced with ``connection: close``):
    the requests behind are then not answered at all, which HTTP/1.1 allows (the client resends
    them), never answered wrongly, and the connection never hangs."""
    good = _request("/v1/completions", COMPLETION)
    bad = _request("/v1/completions", b"{not json")
    missing = b"GET /kairos/state HTTP/1.1\r\nHost: gw\r\n\r\n"
    models = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
    for burst, expected in (([good, missing, models], [200, 404, 200]), ([models, bad, models], [200, 400, 200])):
        answers: list[tuple[int, dict[str, str], bytes]] = []
        with _connect(_port(cluster.gateway_url)) as sock:
            sock.sendall(b"".join(burst))
            buf = bytearray()
            with contextlib.suppress(ConnectionError):  # closed by Envoy: the rest is to resend
                for _ in burst:
                    answers.append(_read_response(sock, buf))
        assert len(answers) >= 2 and [a[0] for a in answers] == expected[: len(answers)]
        for status, _, raw in answers:
            if status >= 400:
                assert_openai_error(status, raw, status)
    still_serving(cluster)


@pytest.fixture(scope="module")
def short_timeout_gateway(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second Envoy in front of the same dispatchers and sidecars, with a 2 s request timeout
    (the default 60 s is the same code path, too long to wait for in a test)."""
    workdir = tmp_path_factory.mktemp("envoy-short")
    port, admin = free_port(), free_port()
    settings = EnvoySettings(
        listen_host="127.0.0.1",
        listen_port=port,
        admin_port=admin,
        dispatchers=tuple(f"127.0.0.1:{p}" for p in cluster.dispatcher_ports),
        sidecars=tuple(n.sidecar_url for n in cluster.nodes if n.role == Role.DECODE),
        request_timeout="2s",
    )
    proc = gateway_process("envoy-short", settings, workdir / "envoy.yaml", workdir / "envoy.log")
    proc.start()
    try:
        proc.wait_ready(60.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def test_a_stalled_body_gets_a_408_and_others_are_served_meanwhile(
    cluster: LocalCluster, short_timeout_gateway: str
) -> None:
    with _connect(_port(short_timeout_gateway)) as stalled:
        # Promise 1000 bytes, send 10, then nothing.
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt":'
        )
        still_serving(cluster, short_timeout_gateway)  # the stalled client holds up no one
        started = time.monotonic()
        status, _, raw = _read_response(stalled, bytearray())
    assert_openai_error(status, raw, 408, "request_timeout")
    assert time.monotonic() - started < 55  # the 2 s timeout fired, not the 60 s socket timeout
    still_serving(cluster, short_timeout_gateway)


def test_a_refused_body_that_stalls_gets_a_408_in_the_request_timeout(
    cluster: LocalCluster, short_timeout_gateway: str
) -> None:
    """Dropping a refused body is bounded in time as reading any body is: a client that stops
    sending gets Envoy's 408 at its request_timeout (2 s here), not a wait without end."""
    declared = defaults.MAX_REQUEST_BODY_BYTES + 1
    assert declared <= defaults.REFUSED_BODY_DRAIN_BYTES  # refused from its head, its body dropped
    with _connect(_port(short_timeout_gateway)) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n{" % declared)
        started = time.monotonic()
        status, _, raw = _read_response(stalled, bytearray())
    assert_openai_error(status, raw, 408, "request_timeout")
    assert time.monotonic() - started < 55  # the 2 s timeout fired, not the 60 s socket timeout
    still_serving(cluster, short_timeout_gateway)


def test_a_client_that_leaves_mid_body_disturbs_nothing(cluster: LocalCluster) -> None:
    for _ in range(3):
        with _connect(_port(cluster.gateway_url)) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5000\r\n\r\n{"pro')
    with _connect(_port(cluster.gateway_url)) as sock:  # half a request line, then gone
        sock.sendall(b"POST /v1/compl")
    still_serving(cluster)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_a_header_envoy_passes_is_read_behind_it(cluster: LocalCluster, path: str) -> None:
    """A 20 KB header (under Envoy's 60 KiB for the whole head) is served as vLLM serves it, on
    both hops of the keep path and on a relayed GET: no server behind Envoy refuses it with a
    non-JSON 400."""
    headers = {"authorization": "Bearer " + "t" * 20_000, "content-type": "application/json"}
    status, answer_headers, raw = http(
        "POST" if path == "/v1/completions" else "GET",
        f"{cluster.gateway_url}{path}",
        COMPLETION if path == "/v1/completions" else None,
        headers,
    )
    assert status == 200, (status, answer_headers.get("content-type"), raw[:200])


@pytest.mark.parametrize(
    ("path", "count", "status"),
    [
        ("/v1/completions", 80, 200),
        ("/v1/completions", 88, 431),  # Envoy takes it, but the routing headers would not fit
        ("/v1/models", 88, 200),  # relayed with no header added: Envoy's limit is its only one
        ("/v1/completions", 120, 431),  # over Envoy's own limit: its 431, the same code
    ],
)
def test_a_head_with_no_room_for_the_routing_headers_is_a_431(
    cluster: LocalCluster, path: str, count: int, status: int
) -> None:
    """Envoy checks the head again once the dispatcher's headers are in, and fails that with a
    503 (header_mutation_result_exceeds_limit): the client must hear a 431 instead."""
    headers = {f"x-client-{i:03d}": "v" for i in range(count)} | {"content-type": "application/json"}
    inference = path == "/v1/completions"
    got, _, raw = http(
        "POST" if inference else "GET", f"{cluster.gateway_url}{path}", COMPLETION if inference else None, headers
    )
    if status == 200:
        assert got == 200, raw[:300]
        return
    error = assert_openai_error(got, raw, 431, "request_headers_too_large")
    assert "headers" in error["message"]
    still_serving(cluster)


def _ext_proc_messages(cluster: LocalCluster) -> int:
    """Messages Envoy has sent on ext_proc streams (its admin stats)."""
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.envoy_admin_port}/stats?filter=ext_proc.stream_msgs_sent")
    return sum(int(line.rsplit(": ", 1)[1]) for line in raw.decode().splitlines() if line.strip())


def _head_status(cluster: LocalCluster, extra_headers: dict[str, str], chunked: bool) -> int:
    """The status of a small completion with ``extra_headers``, its body sent with a
    Content-Length (Envoy's one-message route) or chunked (the headers route)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in extra_headers.items())
    if chunked:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{extra}"
        raw = (head + "Transfer-Encoding: chunked\r\n\r\n").encode()
        raw += f"{len(COMPLETION):x}\r\n".encode() + COMPLETION + b"\r\n0\r\n\r\n"
    else:
        raw = _request("/v1/completions", COMPLETION, extra)
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(raw)
        status, _, _ = _read_response(sock, bytearray())
    return status


def test_a_plain_request_takes_one_ext_proc_message_and_others_two(cluster: LocalCluster) -> None:
    """The one-message route: a completion with a Content-Length reaches the dispatcher as its
    body alone; a chunked one, or one carrying a routing header, as its headers then its body."""
    for extra, chunked, messages in (({}, False, 1), ({}, True, 2), ({c.H_ROUTE: "deflect"}, False, 2)):
        before = _ext_proc_messages(cluster)
        assert _head_status(cluster, extra, chunked) == 200
        assert _ext_proc_messages(cluster) - before == messages, (extra, chunked)


def test_both_routes_measure_a_head_alike(cluster: LocalCluster) -> None:
    """Where the headers route (the dispatcher reads the header map) draws the line for the
    routing headers' room, the one-message route (Envoy's attributes) draws it too: the header
    count and the head's bytes."""
    statuses = {
        count: (_head_status(cluster, headers, False), _head_status(cluster, headers, True))
        for count in range(80, 96)
        for headers in [{f"x-client-{i:03d}": "v" for i in range(count)}]
    }
    assert all(a == b for a, b in statuses.values()), statuses
    assert {a for a, _ in statuses.values()} == {200, 431}, statuses  # the line is inside the range

    def passes(size: int) -> tuple[bool, bool]:
        headers = {"x-client-big": "v" * size}
        one, two = _head_status(cluster, headers, False), _head_status(cluster, headers, True)
        assert {one, two} <= {200, 431}
        return one == 200, two == 200

    low, high = 40_000, 60 * 1024  # passes at low, not at high, on the headers route
    assert passes(low) == (True, True) and passes(high) == (False, False)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if passes(mid)[1] else (low, mid)
    assert passes(low) == (True, True)
    assert passes(high) == (False, False)
    still_serving(cluster)


def _engine_requests(cluster: LocalCluster) -> dict[str, float]:
    """Requests each node's engine holds (running + waiting), from its vLLM metrics."""
    held: dict[str, float] = {}
    for node in cluster.nodes:
        _, _, raw = http("GET", f"http://{node.url}/metrics")
        held[node.node_id] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in raw.decode().splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
    return held


@pytest.mark.parametrize(
    ("stream", "leave_when"),
    [(True, "first event"), (True, Role.PREFILL), (False, Role.PREFILL), (False, Role.DECODE)],
    ids=["stream after its first event", "stream in its prefill hop", "json in its prefill hop", "json decoding"],
)
def test_a_client_that_leaves_leaves_no_request_on_a_node(
    cluster: LocalCluster, tokenizer: PromptTokenizer, stream: bool, leave_when: str
) -> None:
    """The request asks for 20,000 tokens (minutes of decoding); its client leaves after the
    first streamed event, or while a node of the role named holds it: every engine must drop
    it (as vLLM does for its own clients, a JSON reply's included), and the gateway go on."""
    prompt = text_of(tokenizer, 12_000 if leave_when == Role.PREFILL else 2000)  # a long prefill hop, or a short one
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 20_000, "stream": stream}).encode()
    role = {n.node_id: n.role for n in cluster.nodes}
    with _connect(_port(cluster.gateway_url)) as sock:
        sock.sendall(_request("/v1/completions", body))
        if leave_when == "first event":
            seen = bytearray()
            while b"data: " not in seen:  # the first event (the head has no such text)
                chunk = sock.recv(65536)
                assert chunk, f"closed before the first event: {bytes(seen)!r}"
                seen += chunk
            assert seen.startswith(b"HTTP/1.1 200"), bytes(seen[:300])
        else:
            wait_until(
                lambda: any(n for node, n in _engine_requests(cluster).items() if role[node] == leave_when),
                what=f"the request on a {leave_when} node",
            )
    wait_until(
        lambda: not any(_engine_requests(cluster).values()), timeout_s=60, what="every node's engine empty again"
    )
    still_serving(cluster)


# ---------------------------------------------------------------------------------------------
# Property-based fuzz of the whole path
# ---------------------------------------------------------------------------------------------
_text = st.text(st.characters(codec="utf-8"), max_size=40)
_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | _text
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=8
)
_FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "user",
    "vllm_xargs",
    "kv_transfer_params",
    "min_tokens",
    "add_special_tokens",
    "chat_template_kwargs",
    "tools",
    "logprobs",
    "stop",
)
_prompt = st.one_of(_text.filter(bool), st.lists(st.integers(-5, 5000), min_size=1, max_size=8), _json)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", ""]) | _json, "content": _text | _json}
)
_body = st.fixed_dictionaries(
    # max_tokens always set (a chat without one generates to the end of the context: slow, not wrong)
    {"model": st.just(MODEL) | _json, "max_tokens": st.integers(1, 3) | _json.filter(lambda v: v is not None)},
    optional={
        "prompt": _prompt,
        "messages": st.lists(_message, max_size=3) | _json,
        **{name: _json for name in _FIELDS if name not in ("model", "max_tokens", "prompt", "messages")},
    },
)

# Requests that are valid before any damage, so that the damage is what the gateway must catch.
_valid_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": _text.filter(bool), "max_tokens": st.integers(1, 3)},
    optional={"user": _text, "stream": st.booleans()},
) | st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": _text}), min_size=1, max_size=2
        ),
        "max_tokens": st.integers(1, 3),
    },
    optional={"user": _text},
)


def _mangle(raw: bytes, how: int, position: int, junk: bytes) -> bytes:
    """0: as is; 1: truncated; 2: bytes inserted (raw surrogates, NULs, anything); 3: replaced;
    4: inserted at the start of the first string value (valid JSON around the junk)."""
    at = position % (len(raw) + 1)
    if how == 4:
        at = raw.find(b'": "') + 4 if b'": "' in raw else at
        return raw[:at] + junk + raw[at:]
    if how == 1:
        return raw[:at]
    if how == 2:
        return raw[:at] + junk + raw[at:]
    if how == 3:
        return junk
    return raw


@settings(
    max_examples=100,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from([*c.INFERENCE_PATHS, "/tokenize", "/detokenize"]),
    body=_valid_body | _body,
    stream=st.booleans(),
    how=st.integers(0, 4),
    position=st.integers(0, 10_000),
    junk=st.sampled_from([b"\xed\xa0\x80", b"\xed\xbf\xbf"])  # UTF-8-encoded surrogates
    | st.sampled_from([b"\x00", b"\xff", b'"', b"\\u", b"\\ud800", b"}", b"{" * 50])
    | st.binary(max_size=16),
    encoding=st.sampled_from([None, None, None, "gzip", "identity"]),
)
# The cases the adversarial run found (raw surrogates in the prompt, the chat content, another
# field; a compressed body), always tried first.
@example(
    path="/v1/completions",
    body={"prompt": "hi", "model": MODEL, "max_tokens": 1},
    stream=False,
    how=4,
    position=0,
    junk=b"\xed\xa0\x80",
    encoding=None,
)
@example(
    path="/v1/chat/completions",
    body={"messages": [{"content": "hi", "role": "user"}], "max_tokens": 1},
    stream=True,
    how=4,
    position=0,
    junk=b"\xed\xbf\xbf",
    encoding=None,
)
@example(
    path="/v1/completions",
    body={"user": "u", "model": MODEL, "prompt": "hi", "max_tokens": 1},
    stream=False,
    how=4,
    position=0,
    junk=b"\xed\xa0\x80",
    encoding=None,
)
@example(
    path="/v1/completions",
    body={"model": MODEL, "prompt": "hi", "max_tokens": 1},
    stream=False,
    how=0,
    position=0,
    junk=b"",
    encoding="gzip",
)
def test_fuzzed_requests_get_a_success_or_an_openai_4xx_never_a_5xx(
    cluster: LocalCluster,
    path: str,
    body: dict[str, Any],
    stream: bool,
    how: int,
    position: int,
    junk: bytes,
    encoding: str | None,
) -> None:
    if stream:
        body = {**body, "stream": True}
    raw = _mangle(json.dumps(body).encode(), how, position, junk)
    headers = {"content-type": "application/json"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    status, _, answer = http("POST", f"{cluster.gateway_url}{path}", raw, headers, timeout=60)  # a hang fails here
    if status < 300:
        return
    assert 400 <= status < 500, (status, raw[:300], answer[:300])
    assert_openai_error(status, answer, status, vllm_code=True)
