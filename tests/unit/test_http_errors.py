"""The single error -> HTTP mapping: status, OpenAI error body, and no leaks on internal errors."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kairos.api.openai_request import NotFoundError, PayloadTooLargeError, RequestError
from kairos.api.tokenizer import ChatTemplateError, NoChatTemplateError
from kairos.common.errors import (
    ConfigError,
    InvalidRequestError,
    KairosError,
    NoHealthyNodeError,
    ProfileError,
    RequestHeadersTooLargeError,
    UnknownPolicyError,
)
from kairos.common.http_errors import (
    ERROR_TABLE,
    INTERNAL_MESSAGE,
    UpstreamError,
    UpstreamTimeoutError,
    error_body,
    error_json,
    error_status,
)


@dataclass(frozen=True)
class Case:
    exc: BaseException
    status: int
    type: str
    code: str
    param: str | None = None
    exposed: bool = True  # the exception's own message reaches the client


CASES = [
    Case(InvalidRequestError("prompt is empty"), 400, "invalid_request_error", "invalid_request"),
    Case(
        RequestError("max_tokens must be at least 1", "max_tokens"),
        400,
        "invalid_request_error",
        "invalid_request",
        "max_tokens",
    ),
    Case(
        ChatTemplateError("bad part", "messages[0].content"),
        400,
        "invalid_request_error",
        "invalid_request",
        "messages[0].content",
    ),
    Case(NoChatTemplateError("no chat template"), 400, "invalid_request_error", "invalid_request", "messages"),
    Case(PayloadTooLargeError("body is 9 bytes"), 413, "invalid_request_error", "payload_too_large"),
    Case(RequestHeadersTooLargeError("120 headers"), 431, "invalid_request_error", "request_headers_too_large"),
    Case(NotFoundError("no such endpoint '/x'"), 404, "invalid_request_error", "not_found"),
    Case(NoHealthyNodeError("no decode node is healthy"), 503, "service_unavailable", "no_healthy_node"),
    Case(UpstreamError("prefill node reset the connection"), 502, "upstream_error", "upstream_error"),
    Case(UpstreamTimeoutError("decode node did not answer in 30 s"), 504, "upstream_error", "upstream_timeout"),
    Case(ConfigError("/etc/kairos.yaml: bad key"), 500, "internal_error", "internal_error", exposed=False),
    Case(ProfileError("profile missing"), 500, "internal_error", "internal_error", exposed=False),
    Case(UnknownPolicyError("policy 'x'"), 500, "internal_error", "internal_error", exposed=False),
    Case(KairosError("base"), 500, "internal_error", "internal_error", exposed=False),
    Case(RuntimeError("secret /srv/path"), 500, "internal_error", "internal_error", exposed=False),
    Case(KeyError("token"), 500, "internal_error", "internal_error", exposed=False),
    Case(TimeoutError(), 500, "internal_error", "internal_error", exposed=False),
]


@pytest.mark.parametrize("case", CASES, ids=[type(c.exc).__name__ for c in CASES])
def test_mapping(case: Case) -> None:
    assert error_status(case.exc) == case.status
    expected_message = case.exc.message if case.exposed else INTERNAL_MESSAGE  # type: ignore[attr-defined]
    expected = {"error": {"message": expected_message, "type": case.type, "param": case.param, "code": case.code}}
    assert error_body(case.exc) == expected
    assert json.loads(error_json(case.exc)) == expected


def test_internal_errors_never_leak_details_or_tracebacks() -> None:
    try:
        raise ValueError("password=hunter2 at /srv/app.py line 3")
    except ValueError as exc:
        text = error_json(exc).decode()
    assert "hunter2" not in text and "Traceback" not in text and "app.py" not in text
    assert error_body(ConfigError("redis://secret@host"))["error"]["message"] == INTERNAL_MESSAGE


def test_json_is_compact_utf8() -> None:
    data = error_json(InvalidRequestError("prompt «vide»"))
    assert (
        data == b'{"error":{"message":"prompt \xc2\xabvide\xc2\xbb","type":"invalid_request_error","param":null,'
        b'"code":"invalid_request"}}'
    )


def test_non_string_param_is_dropped() -> None:
    exc = InvalidRequestError("x")
    exc.param = 3  # type: ignore[attr-defined]
    assert error_body(exc)["error"]["param"] is None


def test_upstream_timeout_is_an_upstream_error() -> None:
    assert issubclass(UpstreamTimeoutError, UpstreamError)
    assert issubclass(UpstreamError, KairosError)


def test_table_covers_every_client_facing_code() -> None:
    assert {code: m.status for code, m in ERROR_TABLE.items()} == {
        "invalid_request": 400,
        "payload_too_large": 413,
        "request_headers_too_large": 431,
        "not_found": 404,
        "method_not_allowed": 405,
        "request_timeout": 408,
        "unsupported_content_encoding": 415,
        "no_healthy_node": 503,
        "overloaded": 429,
        "upstream_error": 502,
        "upstream_timeout": 504,
    }
    with pytest.raises(TypeError):
        ERROR_TABLE["x"] = ERROR_TABLE["not_found"]  # type: ignore[index]
