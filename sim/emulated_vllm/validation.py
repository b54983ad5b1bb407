"""A request's extensions read as vLLM reads them (``vllm_xargs``, ``kv_transfer_params``), and
the requests vLLM itself refuses, answered as vLLM answers them."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kairos.api.openai_request import RequestError
from kairos.common import contracts as c
from kairos.sim.emulated_vllm.responses import SSE_HEADERS, dumps


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))  # strict UTF-8: surrogate bytes are not text
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def vllm_xargs(value: Any) -> dict[str, Any]:
    """``vllm_xargs`` as vLLM's request schema hands them to its plugins: ``dict[str, str | int |
    float | list[str | int | float]]`` in pydantic's lax mode, which turns a boolean into an int
    (``[true]`` is the schedule ``[1]``). vLLM refuses any other value before a plugin sees it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{c.VLLM_XARGS} must be an object", c.VLLM_XARGS)
    return {key: _xarg_value(key, v) for key, v in value.items()}


def _xarg_value(key: str, value: Any) -> Any:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(x, str | int | float) for x in items):
        param = f"{c.VLLM_XARGS}.{key}"
        raise RequestError(f"{param} must be a string, a number or an array of them, got {dumps(value)}", param)
    coerced = [int(x) if isinstance(x, bool) else x for x in items]
    return coerced if isinstance(value, list) else coerced[0]


# vLLM's SamplingParams._verify_extra_args: its engine transport (MessagePack) carries 64-bit
# integers only. The " (parameter=extra_args)" is how VLLMValidationError renders its parameter.
_EXTRA_ARGS_RANGE = "extra_args integers must be between -2**63 and 2**64 - 1. (parameter=extra_args)"


class VllmValidationError(Exception):
    """A request vLLM refuses with its own ``VLLMValidationError`` (answered by :func:`vllm_rejection`)."""

    def __init__(self, message: str, param: str | None = None, *, in_engine: bool = False) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        self.in_engine = in_engine  # raised as the engine takes the request: a stream's 200 is out


def check_extra_args(*values: Any) -> None:
    """vLLM's range check over the request's extra_args (its vllm_xargs and kv_transfer_params)."""
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise VllmValidationError(_EXTRA_ARGS_RANGE, "extra_args")
        if isinstance(value, dict):
            pending.extend((*value.keys(), *value.values()))
        elif isinstance(value, list):
            pending.extend(value)


async def vllm_rejection(
    request: web.Request, as_event: bool, rid: str, exc: VllmValidationError
) -> web.StreamResponse:
    """vLLM 0.32's answer to a ``VLLMValidationError`` (``create_error_response``; a logits
    processor's ValueError in ``validate_params`` becomes one): a 400 with its error body, compact
    JSON as its JSONResponse writes it; a streamed request refused by the engine has had its 200 and
    headers sent, so it gets that body as its one event (``json.dumps``' default spacing)."""
    body = {"error": {"message": exc.message, "type": "BadRequestError", "param": exc.param, "code": 400}}
    if not as_event:
        return web.Response(status=400, body=dumps(body).encode(), content_type="application/json")
    resp = web.StreamResponse(headers={**SSE_HEADERS, c.H_REQUEST_ID: rid})
    await resp.prepare(request)
    await resp.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


def check_pull_params(params: dict[str, Any], prompt_tokens: int) -> int:
    """A decode hop's kv_transfer_params must say where the KV is, for this very prompt: the
    prompt tokens whose KV it pulls (``remote_num_tokens``, what the prefill node computed, the
    whole prompt where absent). Fewer than the prompt's is a split: the prefill node computed the
    prompt's first k tokens, and this node prefills the rest (Kairos's connector,
    nodeagent/vllm_plugin/split_connector.py, reads ``remote_num_tokens`` on the decode hop as
    the pulled prefix; vLLM's own pulls the whole prompt). Past the prompt is refused, as this
    node refuses a pull of a KV that is not this prompt's."""

    def bad(name: str, what: str) -> RequestError:
        return RequestError(f"{c.KV_TRANSFER_PARAMS}.{name} {what}", f"{c.KV_TRANSFER_PARAMS}.{name}")

    if not isinstance(params.get("remote_engine_id"), str) or not params["remote_engine_id"]:
        raise bad("remote_engine_id", "must be a non-empty string")
    groups = params.get("remote_block_ids")
    if (  # per KV cache group, as vLLM's connector exchanges them
        not isinstance(groups, list)
        or not groups
        or not all(isinstance(g, list) and all(is_int(x) for x in g) for g in groups)
        or not groups[0]
    ):
        raise bad("remote_block_ids", "must be a non-empty array of arrays of integers (one per KV cache group)")
    if not isinstance(params.get("remote_host"), str) or not params["remote_host"]:
        raise bad("remote_host", "must be a non-empty string")
    port = params.get("remote_port")
    if not is_int(port) or not 0 < port < 65536:
        raise bad("remote_port", "must be a port number")
    rid = params.get("remote_request_id")
    if rid is not None and not isinstance(rid, str):
        raise bad("remote_request_id", "must be a string")
    computed = params.get("remote_num_tokens")
    if computed is None or computed == 0:  # vLLM's "none said" (a prefiller that kept no blocks)
        return prompt_tokens
    if not is_int(computed) or computed < 0:
        raise bad("remote_num_tokens", f"must be a non-negative integer, got {dumps(computed)}")
    if computed > prompt_tokens:
        raise bad(
            "remote_num_tokens",
            f"is {computed} but this request's prompt has {prompt_tokens} tokens: the prefill ran another prompt",
        )
    return computed
