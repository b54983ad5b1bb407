"""Kairos's one exception hierarchy.

Every error carries a stable machine-readable ``code``. The HTTP boundary maps codes to
statuses in exactly one place; the core only raises.
"""

from __future__ import annotations


class KairosError(Exception):
    """Base of every error Kairos raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(KairosError):
    """A configuration file, flag or environment variable is invalid."""

    code = "invalid_config"


class ProfileError(KairosError):
    """A latency profile file is missing, malformed or inconsistent."""

    code = "invalid_profile"


class InvalidRequestError(KairosError):
    """The client's request cannot be served as sent (bad body, empty prompt, too long)."""

    code = "invalid_request"


class RequestHeadersTooLargeError(InvalidRequestError):
    """The request's head leaves no room under the gateway's header limits for the routing
    headers the dispatcher adds (431)."""

    code = "request_headers_too_large"


class NotFoundError(KairosError):
    """The path is not an endpoint this server (gateway, sidecar) serves (404)."""

    code = "not_found"


class MethodNotAllowedError(KairosError):
    """The path is served, but not with this method (405)."""

    code = "method_not_allowed"


class UnsupportedContentEncodingError(KairosError):
    """The body is compressed (Content-Encoding other than identity): bodies travel as JSON (415)."""

    code = "unsupported_content_encoding"


class OverloadedError(KairosError):
    """The cluster holds as many requests as its admission budget allows (429, with Retry-After)."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoHealthyNodeError(KairosError):
    """No prefill or decode node is eligible to serve the request right now."""

    code = "no_healthy_node"


class UnknownPolicyError(ConfigError):
    """A policy name or parameter that the policy factory does not know."""

    code = "unknown_policy"
