"""The emulated node answers a chunk schedule exactly as real vLLM with the Kairos plugins does.

Each case is the ``vllm_xargs`` of a request body, sent two ways:

(a) vLLM's way, built from what vLLM 0.32 does, without vLLM: the body's ``vllm_xargs`` validated
    with the type vLLM's request model declares for them (pydantic, which coerces a boolean to an
    int and refuses null or objects); SamplingParams' check that every integer fits 64 bits; then
    the validator plugin's own ``validate_params`` (its module, imported over stand-ins for vLLM
    and torch, which it only names) with those as ``sampling_params.extra_args``; each refusal
    answered as vLLM's API server does (``VLLMValidationError`` -> ``create_error_response``: a 400
    with the OpenAI error body as starlette's JSONResponse writes it; a streamed request that the
    plugin refuses gets a 200 whose one event is that body, its headers being out by then);
(b) a running emulated node over HTTP.

Status, content type and body bytes must be equal. Cases that vLLM's request schema refuses
before any plugin runs are compared by status only (that message is pydantic's own). Every step of
(a) was checked, for every case here, against vLLM 0.32's own code in .venv-vllm (CompletionRequest,
SamplingParams, the validator importing real vLLM, create_error_response, JSONResponse).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pydantic
import pytest
from aiohttp import web

from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.emulated_vllm import EmulatedNodeConfig, build_app

MODEL = "tiny-llama"
PROMPT = list(range(3, 23))  # 20 prompt tokens: an accepted schedule of 1-token chunks is 20 steps
MAX_STEP_TOKENS = 512

# vllm/entrypoints/openai/completion/protocol.py: CompletionRequest.vllm_xargs (chat: the same).
VLLM_XARGS_TYPE = pydantic.TypeAdapter(dict[str, str | int | float | list[str | int | float]])

S, B = c.XARG_CHUNK_SCHEDULE, c.XARG_STEP_BUDGET_MS
# (case, vllm_xargs) that vLLM refuses with its error body: the plugin's parser, or SamplingParams
# for an integer over 64 bits.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("not a list", {S: 512}),
    ("a string", {S: "512,256"}),
    ("a boolean", {S: True}),  # pydantic makes it 1: still not a list
    ("empty list", {S: []}),
    ("zero", {S: [512, 0]}),
    ("negative", {S: [256, -5]}),
    ("float", {S: [1.5]}),
    ("whole float", {S: [256.0]}),  # pydantic keeps a float a float
    ("number as string", {S: [1, "2"]}),
    ("over the cap", {S: [1] * (c.MAX_SCHEDULE_CHUNKS + 1)}),
    ("huge value", {S: [10**30]}),  # over 64 bits: refused before the plugin, streamed or not
    ("huge and over the cap", {S: [10**30] * (c.MAX_SCHEDULE_CHUNKS + 1)}),
    ("huge budget", {S: [8], B: 2**64}),
    ("budget without schedule", {B: 60}),
    ("budget zero", {S: [8], B: 0}),
    ("budget negative", {S: [8], B: -1}),
    ("budget as string", {S: [8], B: "60"}),
    ("budget NaN", {S: [8], B: float("nan")}),
]
# (case, vllm_xargs) that vLLM accepts: the engine runs them (a chunk over its step budget capped).
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("booleans in the list", {S: [True, True]}),  # pydantic makes them [1, 1]
    ("over max_num_batched_tokens", {S: [MAX_STEP_TOKENS * 4]}),
    ("largest 64-bit value", {S: [2**64 - 1]}),
    ("at the cap", {S: [1] * c.MAX_SCHEDULE_CHUNKS}),
    ("no schedule", {"other": "x"}),
]
# (case, vllm_xargs) that vLLM's request schema refuses before the plugin: a 400 either way.
SCHEMA: list[tuple[str, dict[str, Any]]] = [
    ("null", {S: None}),
    ("object", {S: {"a": 1}}),
    ("null in the list", {S: [None]}),
    ("nested list", {S: [[1]]}),
]


# -- (a) vLLM ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validate_params() -> Any:
    """The validator plugin's ``KairosScheduleValidator.validate_params``, as vLLM calls it; its
    module is imported over stand-ins for the vLLM and torch names it imports, then forgotten."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = object  # type: ignore[attr-defined]
    logits = types.ModuleType("vllm.v1.sample.logits_processor")
    logits.BatchUpdate = object  # type: ignore[attr-defined]
    logits.LogitsProcessor = type("LogitsProcessor", (), {})  # type: ignore[attr-defined]
    stand_ins = {
        "torch": types.ModuleType("torch"),
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.sample": types.ModuleType("vllm.v1.sample"),
        "vllm.v1.sample.logits_processor": logits,
    }
    name = "kairos.nodeagent.vllm_plugin.validator"
    with mock.patch.dict(sys.modules, stand_ins):
        sys.modules.pop(name, None)
        module = importlib.import_module(name)
    return module.KairosScheduleValidator.validate_params


def sanitize_message(message: str) -> str:
    """vllm/entrypoints/serve/exception_handling/utils.py, applied to every error message."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def _error(message: str, param: str | None) -> dict[str, Any]:
    """create_error_response(VLLMValidationError(message, parameter=param)).model_dump()"""
    text = f"{message} (parameter={param})" if param is not None else message  # VLLMValidationError.__str__
    return {"error": {"message": sanitize_message(text), "type": "BadRequestError", "param": param, "code": 400}}


def _json_response(error: dict[str, Any]) -> tuple[int, str, bytes]:
    """starlette's JSONResponse(error, status_code=400)"""
    body = json.dumps(error, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    return 400, "application/json", body


def vllm_answer(validate: Any, xargs: dict[str, Any], stream: bool) -> tuple[int, str | None, bytes | None]:
    """(status, content type, body) of vLLM's answer; type and body None when it serves the request."""
    try:
        extra_args = VLLM_XARGS_TYPE.validate_python(xargs)
    except pydantic.ValidationError:
        return 400, None, None  # RequestValidationError: vLLM's validation_exception_handler
    # SamplingParams._verify_extra_args, as the request becomes sampling params (before any stream).
    numbers = [v for value in extra_args.values() for v in (value if isinstance(value, list) else [value])]
    if any(isinstance(v, int) and not -(2**63) <= v < 2**64 for v in numbers):
        return _json_response(_error("extra_args integers must be between -2**63 and 2**64 - 1.", "extra_args"))
    try:
        validate(types.SimpleNamespace(extra_args=extra_args))
    except ValueError as exc:  # validate_logits_processors_parameters: VLLMValidationError(str(exc))
        error = _error(str(exc), None)
        if stream:  # create_streaming_error_response: json.dumps with its default spacing
            return 200, "text/event-stream; charset=utf-8", f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        return _json_response(error)
    return 200, None, None


# -- (b) the emulated node --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@pytest.fixture
async def node(model_dir: Path) -> AsyncIterator[str]:
    config = EmulatedNodeConfig(
        node_id="d0",
        role=Role.DECODE,
        model_dir=str(model_dir),
        model=MODEL,
        time_scale=20.0,
        max_step_tokens=MAX_STEP_TOKENS,
    )
    runner = web.AppRunner(build_app(config))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def node_answer(url: str, xargs: dict[str, Any], stream: bool, chat: bool = False) -> tuple[int, str, bytes]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": stream, c.VLLM_XARGS: xargs}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = PROMPT
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(f"{url}{path}", json=body) as resp,
    ):
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


# -- parity -----------------------------------------------------------------------------------------
def _ids(cases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in cases]


@pytest.mark.parametrize(("case", "xargs"), REFUSED, ids=_ids(REFUSED))
async def test_a_refused_schedule_is_answered_as_vllm_does(
    node: str, validate_params: Any, case: str, xargs: dict[str, Any]
) -> None:
    want = vllm_answer(validate_params, xargs, stream=False)
    assert want[0] == 400, f"{case}: the plugin accepts it"
    assert await node_answer(node, xargs, stream=False) == want
    assert await node_answer(node, xargs, stream=False, chat=True) == want  # one handler for both APIs


@pytest.mark.parametrize(("case", "xargs"), REFUSED, ids=_ids(REFUSED))
async def test_a_refused_streamed_schedule_is_answered_as_vllm_does(
    node: str, validate_params: Any, case: str, xargs: dict[str, Any]
) -> None:
    assert await node_answer(node, xargs, stream=True) == vllm_answer(validate_params, xargs, stream=True)


@pytest.mark.parametrize(("case", "xargs"), ACCEPTED, ids=_ids(ACCEPTED))
async def test_an_accepted_schedule_is_served_as_vllm_serves_it(
    node: str, validate_params: Any, case: str, xargs: dict[str, Any]
) -> None:
    assert vllm_answer(validate_params, xargs, stream=False) == (200, None, None)
    status, _, body = await node_answer(node, xargs, stream=False)
    assert status == 200, body
    assert json.loads(body)["usage"] == {
        "prompt_tokens": len(PROMPT),
        "total_tokens": len(PROMPT) + 2,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
    }


@pytest.mark.parametrize(("case", "xargs"), SCHEMA, ids=_ids(SCHEMA))
async def test_a_value_outside_vllms_schema_is_a_400(
    node: str, validate_params: Any, case: str, xargs: dict[str, Any]
) -> None:
    assert vllm_answer(validate_params, xargs, stream=False)[0] == 400
    status, _, body = await node_answer(node, xargs, stream=False)
    assert status == 400 and json.loads(body)["error"]["param"] == f"{c.VLLM_XARGS}.{S}"
