"""The one place an exception becomes an HTTP status and an OpenAI-style JSON error body.

Every component (the ext_proc server answering Envoy with an immediate response, the decode
sidecar, the emulated engine) calls these functions, so a given error looks the same whichever
part raised it. The mapping goes by ``KairosError.code``, so subclasses defined in other modules
(``kairos.api.openai_request.PayloadTooLargeError``, ...) need no import here. Anything that is
not a known code is a 500 with a generic message: the caller logs the exception, the client
never sees internals.

Body shape (what the openai SDK parses): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kairos.common.errors import KairosError


class UpstreamError(KairosError):
    """A vLLM node (or the sidecar's hop to one) failed: connection refused, reset, bad reply (502)."""

    code = "upstream_error"


class UpstreamTimeoutError(UpstreamError):
    """A vLLM node did not answer in time (504). A subclass, so ``except UpstreamError`` catches both."""

    code = "upstream_timeout"


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    """How one error code is answered."""

    status: int  # HTTP status
    type: str  # the body's error.type


ERROR_TABLE: Mapping[str, ErrorMapping] = MappingProxyType(
    {
        "invalid_request": ErrorMapping(400, "invalid_request_error"),
        "payload_too_large": ErrorMapping(413, "invalid_request_error"),
        "request_headers_too_large": ErrorMapping(431, "invalid_request_error"),
        "not_found": ErrorMapping(404, "invalid_request_error"),  # OpenAI's answer to an unknown URL
        "method_not_allowed": ErrorMapping(405, "invalid_request_error"),
        "unsupported_content_encoding": ErrorMapping(415, "invalid_request_error"),
        "request_timeout": ErrorMapping(408, "invalid_request_error"),
        "no_healthy_node": ErrorMapping(503, "service_unavailable"),
        "overloaded": ErrorMapping(429, "rate_limit_error"),  # admission control (kairos.core.admission)
        "upstream_error": ErrorMapping(502, "upstream_error"),
        "upstream_timeout": ErrorMapping(504, "upstream_error"),
    }
)
INTERNAL_ERROR = ErrorMapping(500, "internal_error")
INTERNAL_CODE = "internal_error"
INTERNAL_MESSAGE = "The gateway had an internal error while processing the request."


def _mapping(exc: BaseException) -> ErrorMapping | None:
    """The table entry for ``exc``, or None when it must be answered as an internal error."""
    if isinstance(exc, KairosError):
        return ERROR_TABLE.get(exc.code)
    return None


def error_status(exc: BaseException) -> int:
    """The HTTP status for ``exc``: from the table by code, 500 for everything else."""
    mapping = _mapping(exc)
    return INTERNAL_ERROR.status if mapping is None else mapping.status


def error_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object for ``exc``; unmapped errors get a generic message and no param."""
    mapping = _mapping(exc)
    if mapping is None or not isinstance(exc, KairosError):
        return {
            "error": {"message": INTERNAL_MESSAGE, "type": INTERNAL_ERROR.type, "param": None, "code": INTERNAL_CODE}
        }
    param = getattr(exc, "param", None)
    return {
        "error": {
            "message": exc.message,
            "type": mapping.type,
            "param": param if isinstance(param, str) else None,
            "code": exc.code,
        }
    }


def error_json(exc: BaseException) -> bytes:
    """``error_body`` serialized as compact UTF-8 JSON, ready to be an HTTP response body."""
    return json.dumps(error_body(exc), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
