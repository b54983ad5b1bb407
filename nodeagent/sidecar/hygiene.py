"""Request hygiene: the client's body read within its bound, identity-encoded, a JSON object of valid
Unicode; the fields and headers only Kairos may set removed; and the bodies' JSON codec."""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from kairos.common import contracts as c
from kairos.common.errors import InvalidRequestError, UnsupportedContentEncodingError

log = logging.getLogger(__package__)

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
RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}


class PayloadTooLargeError(InvalidRequestError):
    """The request body exceeds ``SidecarConfig.max_body_bytes`` (413, by kairos.common.http_errors' table)."""

    code = "payload_too_large"


async def read_body(request: web.Request, limit: int) -> bytes:
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


def check_identity_encoding(headers: CIMultiDictProxy[str]) -> None:
    """Bodies are JSON as sent: a compressed one is a 415 (vLLM does not decode request bodies
    either), before aiohttp tries to inflate it."""
    encoding = headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedContentEncodingError(
            f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed"
        )


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of valid Unicode text: strict UTF-8 (json.loads on bytes would
    let encoded surrogates through), and no lone surrogate from a \\u escape either, since the
    body is encoded again for the hops."""
    try:
        body = loads(raw.decode("utf-8"))
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


def forward_headers(incoming: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
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


def scrub_client_fields(body: dict[str, Any], rid: str) -> dict[str, Any] | None:
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


def named_in_connection(value: str) -> set[str]:
    """The header names a Connection header's value lists (hop-by-hop, RFC 9110 §7.6.1)."""
    return {token.strip().lower() for token in value.split(",") if token.strip()}


class _NonFinite(float):
    """NaN or an infinity read from a body (json.loads takes them): orjson would write null for
    them, so it refuses this type instead and :func:`dumps` falls back to json."""


# One decoder for every body: json.loads with an argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_NonFinite)


def loads(text: str) -> Any:
    return _DECODER.decode(text)


def _json_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of a body read by :func:`loads`, the JSON json.dumps writes (the same
    values; floats may be spelled differently, 1e-7 for 1e-07). orjson takes 3 us where json
    takes 0.5 ms on a 100 KB prompt, and the keep path writes two bodies; what orjson refuses
    (NaN and infinities, integers past 64 bits, lone surrogates) is json's, as before."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return _json_dumps(obj)
