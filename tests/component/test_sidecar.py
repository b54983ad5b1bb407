"""Component tests of the decode-node sidecar: real HTTP on 127.0.0.1 against fake vLLM servers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

import kairos.nodeagent.sidecar.app as sidecar_app
from kairos.common import contracts as c
from kairos.common.errors import ConfigError
from kairos.launcher.processes import free_port
from kairos.launcher.tinymodel import build_tiny_model
from kairos.nodeagent.heartbeat import SidecarProbe
from kairos.nodeagent.sidecar import (
    HOP1_KV_TRANSFER_PARAMS,
    SidecarConfig,
    SidecarMetrics,
    TtftFeedbackPublisher,
    app_runner,
)
from kairos.sim.emulated_vllm import VLLM_MAX_HEAD_BYTES, VLLM_MAX_HEADERS, EmulatedNodeConfig
from kairos.sim.emulated_vllm import app_runner as emulated_node
from tests.redis_server import RedisServer
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
# What a NixlConnector prefill node puts in its reply (the shape vLLM returns).
PREFILL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p0",
    "remote_block_ids": [3, 4, 5],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 20,
    "max_completion_tokens": 20,
    "min_tokens": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
}
COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}
STREAMED = {**COMPLETION, "stream": True}  # a TTFT sample needs a stream: its first event is the first token


# ---------------------------------------------------------------------------------------------
# Fake vLLM servers
# ---------------------------------------------------------------------------------------------
@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


@dataclass
class FakeVLLM:
    """A vLLM OpenAI server stand-in that records every request it receives."""

    role: str  # "prefill" or "decode"
    seen: list[Seen] = field(default_factory=list)
    status: int = 200  # status of completion replies (errors carry vLLM's error JSON)
    hang: bool = False  # prefill: accept the request and never answer
    with_kv: bool = True  # prefill: put kv_transfer_params in the reply
    kv: dict[str, Any] = field(default_factory=lambda: PREFILL_KV)  # prefill: those params; decode: expects them
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # decode: holds the stream's tail
    use_gate: bool = False
    sent_last: bool = False
    break_stream: bool = False  # decode: drop the connection after the first chunk
    error_event: bool = False  # decode: a stream that carries an error event, as vLLM's in-engine refusals
    reader_gone: asyncio.Event = field(default_factory=asyncio.Event)  # decode: a stream write failed
    health_status: int = 200
    tokenize_ids: list[int] = field(default_factory=lambda: [1])  # /tokenize: the prompt's ids
    tokenize_status: int = 200
    tokenize_reply: dict[str, Any] | None = None  # /tokenize: this reply instead
    release: asyncio.Event = field(default_factory=asyncio.Event)  # set at teardown: ends hangs
    url: str = ""  # host:port once started

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get(c.STATE_PATH, self._metrics)
        app.router.add_route("*", "/kairos/kv/pull", self._metrics)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.tokenize_status != 200:
            error = {"object": "error", "message": "fake tokenize error", "type": "BadRequestError", "code": 400}
            return web.json_response(error, status=self.tokenize_status)
        ids = self.tokenize_ids
        reply = self.tokenize_reply or {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
        return web.json_response(reply)

    async def _record(self, request: web.Request) -> Seen:
        seen = Seen(
            request.method, request.path_qs, {k.lower(): v for k, v in request.headers.items()}, await request.read()
        )
        self.seen.append(seen)
        return seen

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = (await self._record(request)).json
        if self.hang:
            await self.release.wait()
        if self.status != 200:
            error = {
                "object": "error",
                "message": f"fake {self.role} error",
                "type": "BadRequestError",
                "param": None,
                "code": self.status,
            }
            return web.json_response(error, status=self.status)
        if self.role == "prefill":
            reply: dict[str, Any] = {"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}]}
            if self.with_kv:
                reply["kv_transfer_params"] = self.kv
            return web.json_response(reply)
        # decode: a keep request must carry the prefill node's params, as a real decode vLLM needs
        route_keep = body.get("kv_transfer_params") is not None
        if route_keep and body["kv_transfer_params"] != self.kv:
            return web.json_response({"error": "wrong kv_transfer_params"}, status=400)
        if not body.get("stream"):
            if self.use_gate:
                try:
                    await asyncio.wait_for(self.gate.wait(), 30)
                except asyncio.CancelledError:  # its client left: vLLM's with_cancellation aborts here
                    self.reader_gone.set()
                    raise
            return web.json_response({"id": "cmpl-d", "choices": [{"index": 0, "text": "hi there"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.error_event:
            error = {"message": "fake in-engine refusal", "type": "BadRequestError", "param": None, "code": 400}
            await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
            return out
        await out.write(b'data: {"n": 1}\n\n')
        if self.break_stream:
            assert request.transport is not None
            request.transport.close()
            return out
        try:
            if self.use_gate:
                await asyncio.wait_for(self.gate.wait(), 5)
            for n in (2, 3):
                await asyncio.sleep(0.02)
                await out.write(f'data: {{"n": {n}}}\n\n'.encode())
            await out.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # vLLM aborts the request here
            self.reader_gone.set()
            return out
        except asyncio.CancelledError:  # or here, cancelled as the connection drops (with_cancellation)
            self.reader_gone.set()
            raise
        self.sent_last = True
        await out.write_eof()
        return out

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.Response(text="vllm:num_requests_running 0\n")


async def _serve(app: web.Application | web.AppRunner) -> tuple[web.AppRunner, str]:
    """Serve a fake vLLM's app (its handlers cancelled when the client leaves, and request heads
    read, as vLLM's are) or the sidecar's own runner."""
    runner = (
        app
        if isinstance(app, web.AppRunner)
        else web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=0.1,
            handler_cancellation=True,
            max_line_size=VLLM_MAX_HEAD_BYTES,
            max_field_size=VLLM_MAX_HEAD_BYTES,
            max_headers=VLLM_MAX_HEADERS,
        )
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"{host}:{port}"


def _dead_port() -> str:
    return f"127.0.0.1:{free_port()}"  # reserved, below the ephemeral range: nothing takes it meanwhile


@dataclass
class Rig:
    prefill: FakeVLLM
    decode: FakeVLLM
    start_sidecar: Callable[..., Awaitable[str]]  # (**config overrides) -> sidecar base URL
    http: aiohttp.ClientSession


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    prefill, decode = FakeVLLM("prefill"), FakeVLLM("decode")
    runners = []
    for fake in (prefill, decode):
        runner, fake.url = await _serve(fake.app())
        runners.append(runner)

    async def start_sidecar(allowlist: Callable[[], Any] | None = None, **overrides: Any) -> str:
        settings: dict[str, Any] = {
            "port": 0,
            "local_vllm": decode.url,
            "allowed_prefill_hosts": (prefill.url,),
            "hop1_connect_timeout_s": 0.5,
            "hop1_timeout_s": 2.0,
            "hop2_timeout_s": 2.0,
            "max_body_bytes": 64 * 1024,
        }
        settings.update(overrides)
        runner, url = await _serve(app_runner(SidecarConfig(**settings), allowlist, shutdown_timeout=0.1))
        runners.append(runner)
        return f"http://{url}"

    async with aiohttp.ClientSession() as http:
        yield Rig(prefill, decode, start_sidecar, http)
    for fake in (prefill, decode):
        fake.release.set()
        fake.gate.set()
    for runner in reversed(runners):
        await runner.cleanup()


def _keep(rig: Rig, **extra: str) -> dict[str, str]:
    return {c.H_ROUTE: "keep", c.H_PREFILL_HOST: rig.prefill.url, **extra}


async def _error(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The OpenAI error object of ``resp``, checked for shape."""
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    raise AssertionError(f"{prefix!r} not in metrics")


# ---------------------------------------------------------------------------------------------
# keep: two hops
# ---------------------------------------------------------------------------------------------
async def test_keep_runs_both_hops_and_streams_unbuffered(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.decode.use_gate = True
    headers = _keep(
        rig,
        **{
            "X-Request-Id": "req-keep-1",
            "Authorization": "Bearer sk-test",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-kairos-spoofed": "evil",
            "Connection": "keep-alive, x-private",
            "x-private": "hop-by-hop",
        },
    )
    async with rig.http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert resp.headers["X-Request-Id"] == "req-keep-1"
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)
        assert first == b'data: {"n": 1}\n\n'
        # The fake holds the rest of the stream until we say so: the first event got here alone.
        assert not rig.decode.sent_last
        rig.decode.gate.set()
        rest = await resp.content.read()
    assert rest == b'data: {"n": 2}\n\ndata: {"n": 3}\n\ndata: [DONE]\n\n'

    (hop1,) = rig.prefill.seen
    (hop2,) = rig.decode.seen
    assert hop1.path == hop2.path == "/v1/chat/completions"
    want_hop1 = {k: v for k, v in CHAT.items() if k not in ("stream_options", "min_tokens")}
    want_hop1.update(max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=HOP1_KV_TRANSFER_PARAMS)
    assert hop1.json == want_hop1
    assert hop2.json == {**CHAT, "kv_transfer_params": PREFILL_KV}
    for seen in (hop1, hop2):
        assert seen.headers["x-request-id"] == "req-keep-1"
        assert seen.headers["authorization"] == "Bearer sk-test"
        assert seen.headers["traceparent"] == headers["traceparent"]
        assert not [h for h in seen.headers if h.startswith(c.HEADER_PREFIX)]
        assert "x-private" not in seen.headers


async def test_client_disconnect_closes_the_upstream_stream(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.decode.use_gate = True
    body = {**COMPLETION, "stream": True}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_keep(rig)) as resp:
        assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2) == b'data: {"n": 1}\n\n'
        resp.close()  # the client goes away mid-stream
    rig.decode.gate.set()
    # The sidecar notices on its next write and drops hop 2, so the decode vLLM stops generating.
    await asyncio.wait_for(rig.decode.reader_gone.wait(), 2)
    assert not rig.decode.sent_last


@pytest.mark.parametrize("route", ["keep", "deflect"])
async def test_client_disconnect_before_a_json_reply_aborts_the_upstream_request(rig: Rig, route: str) -> None:
    """A non-streaming reply has no byte to fail on until its end: the sidecar must notice the
    client leave and drop its hop, or the node generates to the last token for no one."""
    url = await rig.start_sidecar(hop2_timeout_s=60.0)  # no timeout of ours drops the hop meanwhile
    rig.decode.use_gate = True  # the decode vLLM holds its reply until the gate opens (30 s at most)
    headers = _keep(rig) if route == "keep" else {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "4"}
    request = asyncio.create_task(rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers))
    await eventually(lambda: any(s.path == "/v1/completions" for s in rig.decode.seen), 5, "hop 2 on the decode vLLM")
    request.cancel()  # the client goes away while the node generates
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await asyncio.wait_for(rig.decode.reader_gone.wait(), 20)

    async def counted() -> bool:  # the cancelled handler's last step, just after it dropped the hop
        text = await _sidecar_metrics(rig, url)
        return _metric(text, "kairos_sidecar_ttft_unobserved_total", path=route, reason="aborted") == 1

    await eventually(counted, what="the request counted as aborted")


@pytest.mark.parametrize("route", ["keep", "deflect"])
async def test_a_header_aiohttp_would_refuse_by_default_reaches_vllm(rig: Rig, route: str) -> None:
    """A 20 KB header (a long bearer token, a big trace context) is read and relayed, as vLLM
    reads it: not aiohttp's text/plain 400 at its 8190-byte default."""
    url = await rig.start_sidecar()
    token = "Bearer " + "t" * 20_000
    headers = {
        "authorization": token,
        **(_keep(rig) if route == "keep" else {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "4"}),
    }
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    assert rig.decode.seen[-1].headers["authorization"] == token


async def test_keep_generates_one_request_id_for_both_hops(rig: Rig) -> None:
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 200
        assert await resp.json() == {"id": "cmpl-d", "choices": [{"index": 0, "text": "hi there"}]}
        rid = resp.headers["X-Request-Id"]
    assert rid
    assert rig.prefill.seen[0].headers["x-request-id"] == rid == rig.decode.seen[0].headers["x-request-id"]
    assert rig.prefill.seen[0].json["max_tokens"] == 1
    assert "max_completion_tokens" not in rig.prefill.seen[0].json


@pytest.mark.parametrize(
    ("failure", "kind", "bound_s"),
    [
        ("hangs", "timeout", 0.5 + 2.5),  # the hop-1 bound, not the hang (slack for a busy CI)
        ("dead", "connect", 0.9),  # refused at once: under the 1 s connect timeout, no retries
        ("500", "status_5xx", None),
        ("no kv_transfer_params", "no_kv_transfer_params", None),
    ],
)
async def test_a_failed_hop_1_is_prefilled_on_the_local_vllm(
    rig: Rig, failure: str, kind: str, bound_s: float | None
) -> None:
    """A prefill node that dies, resets, fails or hangs before any byte reached the client does
    not lose the request: the local vLLM prefills it (no kv_transfer_params), and the client
    gets its answer. Envoy's retry could not help: another decode node calls the same prefill."""
    dead = _dead_port()
    url = await rig.start_sidecar(hop1_timeout_s=0.5, allowed_prefill_hosts=(rig.prefill.url, dead))
    headers = _keep(rig)
    if failure == "hangs":
        rig.prefill.hang = True
    elif failure == "dead":
        headers[c.H_PREFILL_HOST] = dead
    elif failure == "500":
        rig.prefill.status = 500
    else:
        rig.prefill.with_kv = False
    started = time.monotonic()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    if bound_s is not None:
        assert time.monotonic() - started < bound_s
    [local] = rig.decode.seen
    assert c.KV_TRANSFER_PARAMS not in local.json and local.json["prompt"] == COMPLETION["prompt"]
    text = await _sidecar_metrics(rig, url)
    assert _metric(text, "kairos_sidecar_local_prefills_total") == 1
    assert _metric(text, "kairos_sidecar_hop_errors_total", hop="1", kind=kind) == 1


async def test_a_failed_hop_1_is_prefilled_locally_under_the_keeps_step_budget(rig: Rig) -> None:
    """The keep carries its decode node's step budget: the local prefill runs as a deflection
    with a one-size schedule of the whole prompt, so the node's guard holds every step that
    carries its chunks within the budget (without it, an unscheduled prefill on a decode node
    takes whole steps beside the decodes). The client's own xargs stay."""
    url = await rig.start_sidecar()
    rig.prefill.status = 500
    headers = _keep(rig, **{c.H_STEP_BUDGET_MS: "70.000", c.H_PROMPT_TOKENS: "2"})
    body = {**COMPLETION, c.VLLM_XARGS: {"mine": 1}}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    [local] = rig.decode.seen
    assert c.KV_TRANSFER_PARAMS not in local.json
    assert local.json[c.VLLM_XARGS] == {"mine": 1, c.XARG_CHUNK_SCHEDULE: [2], c.XARG_STEP_BUDGET_MS: 70.0}
    assert c.parse_schedule_xargs(local.json[c.VLLM_XARGS]) == c.ChunkPlan((2,), 0.070)


@pytest.mark.parametrize("route", ["keep", "keep_local_prefill", "deflect"])
async def test_the_local_hop_carries_the_decided_tpot_slo_and_every_hop_the_priority(rig: Rig, route: str) -> None:
    """The decode node's vLLM gets the TPOT SLO the dispatcher decided by in vllm_xargs (its
    guard and heartbeat read it); the prefill hop does not (a prefill node runs no decodes).
    vLLM's priority reaches every hop as the client sent it."""
    url = await rig.start_sidecar()
    headers = {c.H_DECIDED_TPOT_SLO_MS: "60", c.H_STEP_BUDGET_MS: "40", c.H_PROMPT_TOKENS: "2"}
    if route == "deflect":
        headers |= {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "2"}
    else:
        headers |= _keep(rig)
    if route == "keep_local_prefill":
        rig.prefill.status = 500
    body = {**COMPLETION, "priority": -3, c.VLLM_XARGS: {"mine": 1}}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    [local] = rig.decode.seen
    assert local.json["priority"] == -3
    assert local.json[c.VLLM_XARGS]["mine"] == 1
    assert local.json[c.VLLM_XARGS][c.XARG_TPOT_SLO_MS] == 60.0
    assert c.parse_tpot_xarg(local.json[c.VLLM_XARGS]) == pytest.approx(0.060)
    if route == "keep":
        assert local.json[c.KV_TRANSFER_PARAMS] == PREFILL_KV
        assert c.XARG_CHUNK_SCHEDULE not in local.json[c.VLLM_XARGS]
    else:
        assert local.json[c.VLLM_XARGS][c.XARG_CHUNK_SCHEDULE] == [2]
    if route != "deflect":
        [hop1] = rig.prefill.seen
        assert hop1.json["priority"] == -3
        assert hop1.json[c.VLLM_XARGS] == {"mine": 1}


async def test_without_a_decided_tpot_the_local_hop_carries_none(rig: Rig) -> None:
    """An older dispatcher's request: no TPOT xarg, the node counts the cluster's default."""
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 200
    assert c.VLLM_XARGS not in rig.decode.seen[0].json


async def test_prefill_4xx_is_relayed(rig: Rig) -> None:
    """The prefill vLLM's 4xx is its verdict on the client's own request: relayed, not retried."""
    url = await rig.start_sidecar()
    rig.prefill.status = 400
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 400
        assert (await resp.json())["message"] == "fake prefill error"
    assert rig.decode.seen == []


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:1",  # well formed, not on the allowlist
        "evil.example.com:80",
        "{prefill}/v1/x",  # an allowed host with a path smuggled in
        "http://{prefill}",
        "user@{prefill}",
    ],
)
async def test_prefill_host_off_the_allowlist_is_never_called(rig: Rig, host: str) -> None:
    url = await rig.start_sidecar()
    headers = {c.H_ROUTE: "keep", c.H_PREFILL_HOST: host.format(prefill=rig.prefill.url)}
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 502
        error = await _error(resp)
    assert "allowlist" in error["message"] or "bad routing headers" in error["message"]
    assert rig.prefill.seen == [] and rig.decode.seen == []


async def test_live_allowlist_admits_a_host_the_static_one_lacks(rig: Rig) -> None:
    live: set[str] = set()
    url = await rig.start_sidecar(allowlist=lambda: live, allowed_prefill_hosts=())
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 502
    live.add(rig.prefill.url.upper())  # case does not matter
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 200
    assert len(rig.prefill.seen) == 1


async def test_failing_live_allowlist_falls_back_to_the_static_one(rig: Rig) -> None:
    def broken() -> set[str]:
        raise ConnectionError("redis down")

    url = await rig.start_sidecar(allowlist=broken)
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 200


async def test_keep_without_prefill_host_is_a_bad_routing_header(rig: Rig) -> None:
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers={c.H_ROUTE: "keep"}) as resp:
        assert resp.status == 502
        assert "bad routing headers" in (await _error(resp))["message"]


# ---------------------------------------------------------------------------------------------
# deflect and unrouted requests
# ---------------------------------------------------------------------------------------------
async def test_deflect_puts_the_schedule_in_vllm_xargs(rig: Rig) -> None:
    url = await rig.start_sidecar()
    body = {**COMPLETION, "vllm_xargs": {"foo": 1, c.XARG_CHUNK_SCHEDULE: [9]}}
    headers = {
        c.H_ROUTE: "deflect",
        c.H_CHUNK_SCHEDULE: "1020,508,252",
        c.H_STEP_BUDGET_MS: "70.000",
        c.H_PREFILL_HOST: rig.prefill.url,
    }
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
    (seen,) = rig.decode.seen
    assert seen.json == {
        **COMPLETION,
        "vllm_xargs": {"foo": 1, c.XARG_CHUNK_SCHEDULE: [1020, 508, 252], c.XARG_STEP_BUDGET_MS: 70.0},
    }
    assert rig.prefill.seen == []


async def test_deflect_without_step_budget_omits_it(rig: Rig) -> None:
    url = await rig.start_sidecar()
    headers = {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "256"}
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 200
    assert rig.decode.seen[0].json["vllm_xargs"] == {c.XARG_CHUNK_SCHEDULE: [256]}


@pytest.mark.parametrize(
    "headers",
    [
        {c.H_ROUTE: "deflect"},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "1020,abc"},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512,0"},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: ""},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512", c.H_STEP_BUDGET_MS: "nan"},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512", c.H_DECIDED_TPOT_SLO_MS: "0"},
        {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512", c.H_DECIDED_TPOT_SLO_MS: "fast"},
        {c.H_ROUTE: "sideways"},
    ],
)
async def test_bad_routing_headers_give_502(rig: Rig, headers: dict[str, str]) -> None:
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 502
        error = await _error(resp)
    assert error["message"].startswith("bad routing headers")
    assert rig.decode.seen == [] and rig.prefill.seen == []


# ---------------------------------------------------------------------------------------------
# split: the prompt's first k tokens on the prefill node, the rest here
# ---------------------------------------------------------------------------------------------
SPLIT_KV = {**PREFILL_KV, "remote_num_tokens": 3}  # vLLM 0.32's reply says the tokens it computed


def _split(rig: Rig, k: str = "3", schedule: str = "2", prompt_tokens: str = "5", **extra: str) -> dict[str, str]:
    return {
        c.H_ROUTE: "split",
        c.H_PREFILL_HOST: rig.prefill.url,
        c.H_SPLIT_TOKENS: k,
        c.H_CHUNK_SCHEDULE: schedule,
        c.H_PROMPT_TOKENS: prompt_tokens,
        **extra,
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_split_sends_the_first_k_token_ids_to_the_prefill_node_and_the_rest_with_its_schedule(
    rig: Rig, path: str
) -> None:
    """Hop 1 is a completions body of the prompt's first k ids, whatever the client's endpoint;
    hop 2 the client's body with the prefill node's params and the schedule of the rest. A chat's
    ids come from the local vLLM's /tokenize, asked with the request's template fields."""
    url = await rig.start_sidecar()
    rig.prefill.kv = rig.decode.kv = SPLIT_KV
    ids = [11, 12, 13, 14, 15]
    if path == "/v1/chat/completions":
        body = {**{k: v for k, v in CHAT.items() if k != "min_tokens"}, "chat_template_kwargs": {"x": 1}, "tools": []}
        rig.decode.tokenize_ids = ids
    else:
        body = {**COMPLETION, "prompt": ids}
    body |= {"priority": 2, "cache_salt": "tenant-a", c.VLLM_XARGS: {"mine": 1}}
    headers = _split(rig, **{c.H_STEP_BUDGET_MS: "40", c.H_DECIDED_TPOT_SLO_MS: "60", c.H_REQUEST_ID: "split-1"})
    async with rig.http.post(f"{url}{path}", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers[c.H_SPLIT_TOKENS] == "3" and resp.headers[c.H_ROUTE] == "split"
        await resp.read()
    (hop1,) = rig.prefill.seen
    assert hop1.path == "/v1/completions" and hop1.headers["x-request-id"] == "split-1"
    assert hop1.json == {
        "model": "tiny",
        "prompt": [11, 12, 13],
        "max_tokens": 1,
        "stream": False,
        "priority": 2,
        "cache_salt": "tenant-a",
        c.VLLM_XARGS: {"mine": 1},
        c.KV_TRANSFER_PARAMS: HOP1_KV_TRANSFER_PARAMS,
    }
    *tokenize, hop2 = rig.decode.seen
    assert hop2.path == path
    xargs = {"mine": 1, c.XARG_CHUNK_SCHEDULE: [2], c.XARG_STEP_BUDGET_MS: 40.0, c.XARG_TPOT_SLO_MS: 60.0}
    assert hop2.json == {**body, c.KV_TRANSFER_PARAMS: SPLIT_KV, c.VLLM_XARGS: xargs}
    if path == "/v1/chat/completions":
        (asked,) = tokenize
        assert asked.path == "/tokenize"
        assert asked.json == {
            "model": "tiny",
            "messages": CHAT["messages"],
            "add_generation_prompt": True,
            "chat_template_kwargs": {"x": 1},
            "tools": [],
        }
    else:
        assert tokenize == []  # the prompt's ids are in the body


async def test_a_text_prompt_is_tokenized_with_the_clients_special_tokens(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.prefill.kv = rig.decode.kv = SPLIT_KV
    rig.decode.tokenize_ids = [7, 8, 9, 10, 11]
    body = {**COMPLETION, "prompt": ["hello there"], "add_special_tokens": False}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_split(rig)) as resp:
        assert resp.status == 200
    tokenize, _ = rig.decode.seen
    assert tokenize.json == {"model": "tiny", "prompt": "hello there", "add_special_tokens": False}
    assert rig.prefill.seen[0].json["prompt"] == [7, 8, 9]


@pytest.mark.parametrize(
    ("tokenize", "reason"),
    [
        ({"ids": [1, 2, 3, 4]}, "prompt_mismatch"),  # the dispatcher counted 5
        ({"status": 400}, "tokenize_failed"),
        ({"reply": {"count": 5, "tokens": "no"}}, "tokenize_failed"),
        ({"prompt": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]}, "unsupported_prompt"),
        ({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 4}, "unsupported_prompt"),
    ],
)
async def test_a_split_that_cannot_be_split_here_is_served_as_a_keep(
    rig: Rig, tokenize: dict[str, Any], reason: str
) -> None:
    url = await rig.start_sidecar()
    rig.decode.tokenize_ids = tokenize.get("ids", [1, 2, 3, 4, 5])
    rig.decode.tokenize_status = tokenize.get("status", 200)
    rig.decode.tokenize_reply = tokenize.get("reply")
    body = {**COMPLETION, "prompt": tokenize.get("prompt", "hello there")}
    if "truncate_prompt_tokens" in tokenize:
        body["truncate_prompt_tokens"] = tokenize["truncate_prompt_tokens"]
    keep_predicted = {c.H_PRED_TTFT_PREFILL_MS: "100", c.H_PRED_TTFT_DECODE_MS: "50"}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_split(rig, **keep_predicted)) as resp:
        assert resp.status == 200, await resp.text()
    (hop1,) = rig.prefill.seen
    assert hop1.json["prompt"] == body["prompt"] and hop1.path == "/v1/completions"  # a keep's hop 1
    assert rig.decode.seen[-1].json == {**body, c.KV_TRANSFER_PARAMS: PREFILL_KV}
    text = await _sidecar_metrics(rig, url)
    assert _metric(text, "kairos_sidecar_split_degraded_total", reason=reason) == 1
    assert _metric(text, "kairos_sidecar_hop1_seconds_count", path="keep") == 1
    assert _metric(text, "kairos_sidecar_hop1_seconds_count", path="split") == 0


async def test_a_prefill_reply_without_the_splits_token_count_is_prefilled_locally(rig: Rig) -> None:
    """A prefill node that does not say it computed the first k tokens (no remote_num_tokens: a
    vLLM older than 0.32, or more than k) cannot be pulled from: the local vLLM prefills it all."""
    url = await rig.start_sidecar()
    body = {**COMPLETION, "prompt": [1, 2, 3, 4, 5]}
    for kv in (PREFILL_KV, {**PREFILL_KV, "remote_num_tokens": 4}):
        rig.prefill.kv = kv
        headers = _split(rig, **{c.H_STEP_BUDGET_MS: "40"})
        async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        local = rig.decode.seen[-1].json
        assert c.KV_TRANSFER_PARAMS not in local
        assert local[c.VLLM_XARGS] == {c.XARG_CHUNK_SCHEDULE: [5], c.XARG_STEP_BUDGET_MS: 40.0}
    text = await _sidecar_metrics(rig, url)
    assert _metric(text, "kairos_sidecar_hop_errors_total", hop="1", kind="split_tokens_mismatch") == 2
    assert _metric(text, "kairos_sidecar_local_prefills_total") == 2


async def test_a_split_relays_the_prefill_nodes_4xx(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.prefill.status = 404
    body = {**COMPLETION, "prompt": [1, 2, 3, 4, 5]}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_split(rig)) as resp:
        assert resp.status == 404
        assert (await resp.json())["message"] == "fake prefill error"
    assert rig.decode.seen == []


@pytest.mark.parametrize(
    "overrides",
    [
        {c.H_SPLIT_TOKENS: "5"},  # k not below the prompt
        {c.H_SPLIT_TOKENS: "9"},
        {c.H_SPLIT_TOKENS: "three"},
        {c.H_SPLIT_TOKENS: "0"},
        {c.H_SPLIT_TOKENS: None},
        {c.H_CHUNK_SCHEDULE: None},
        {c.H_CHUNK_SCHEDULE: "1"},  # the schedule does not cover the prompt's rest
        {c.H_CHUNK_SCHEDULE: "2,x"},
        {c.H_PROMPT_TOKENS: "five"},
        {c.H_STEP_BUDGET_MS: "-1"},
        {c.H_PREFILL_HOST: None},
        {c.H_PREFILL_HOST: "http://evil/x"},
    ],
)
async def test_bad_split_headers_give_502(rig: Rig, overrides: dict[str, str | None]) -> None:
    url = await rig.start_sidecar()
    headers = {k: v for k, v in {**_split(rig), **overrides}.items() if v is not None}
    body = {**COMPLETION, "prompt": [1, 2, 3, 4, 5]}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 502
        assert (await _error(resp))["message"].startswith("bad routing headers")
    assert rig.decode.seen == [] and rig.prefill.seen == []


async def test_unrouted_request_goes_to_the_local_vllm_unchanged(rig: Rig) -> None:
    url = await rig.start_sidecar()
    raw = b'{"model": "tiny",  "prompt": "byte for byte", "max_tokens": 3}'
    headers = {"Content-Type": "application/json", "X-Request-Id": "direct-1", "x-kairos-chunk-schedule": "1"}
    async with rig.http.post(f"{url}/v1/completions?trace=1", data=raw, headers=headers) as resp:
        assert resp.status == 200
    (seen,) = rig.decode.seen
    assert seen.raw == raw
    assert seen.path == "/v1/completions?trace=1"
    assert seen.headers["x-request-id"] == "direct-1"
    assert not [h for h in seen.headers if h.startswith(c.HEADER_PREFIX)]
    assert rig.prefill.seen == []


async def test_client_sent_kairos_xargs_never_reach_vllm(rig: Rig) -> None:
    url = await rig.start_sidecar()
    body = {**COMPLETION, "vllm_xargs": {c.XARG_CHUNK_SCHEDULE: [1], c.XARG_STEP_BUDGET_MS: 1.0, "foo": "bar"}}
    async with rig.http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_keep(rig)) as resp:
        assert resp.status == 200
    # the client's other xargs stay, on both hops
    assert [s.json["vllm_xargs"] for s in rig.decode.seen] == [{"foo": "bar"}, {"foo": "bar"}]
    assert rig.prefill.seen[0].json["vllm_xargs"] == {"foo": "bar"}


# ---------------------------------------------------------------------------------------------
# hop 2 failures, client errors
# ---------------------------------------------------------------------------------------------
async def test_local_vllm_errors_relay_4xx_and_map_5xx_and_dead_to_502(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.decode.status = 400
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 400
        assert (await resp.json())["message"] == "fake decode error"
    rig.decode.status = 503
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 502
        assert "answered 503" in (await _error(resp))["message"]
    dead_url = await rig.start_sidecar(local_vllm=_dead_port())
    async with rig.http.post(f"{dead_url}/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 502
        assert (await _error(resp))["code"] == "upstream_error"


async def test_stream_broken_mid_way_ends_with_an_error_event(rig: Rig) -> None:
    url = await rig.start_sidecar()
    rig.decode.break_stream = True
    async with rig.http.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        assert resp.status == 200
        text = (await resp.content.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0] == 'data: {"n": 1}'
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_error"


async def test_an_error_event_in_place_of_the_first_token_is_no_ttft(rig: Rig) -> None:
    """vLLM refuses some streamed requests in its engine, after the 200: the stream's first event
    is then an error, not a token, and must not become a TTFT sample."""
    url = await rig.start_sidecar()
    rig.decode.error_event = True
    headers = {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512", c.H_PRED_TTFT_DECODE_MS: "100"}
    async with rig.http.post(f"{url}/v1/completions", json=STREAMED, headers=headers) as resp:
        assert resp.status == 200
        assert b'"error"' in await resp.read()
    text = await _sidecar_metrics(rig, url)
    assert _metric(text, "kairos_sidecar_ttft_seconds_count", path="deflect") == 0
    assert _metric(text, "kairos_sidecar_ttft_observed_over_predicted_count", path="deflect") == 0
    assert _metric(text, "kairos_sidecar_ttft_unobserved_total", path="deflect", reason="error") == 1


async def test_too_large_and_malformed_bodies_get_openai_errors(rig: Rig) -> None:
    url = await rig.start_sidecar(max_body_bytes=1000)
    big = {**COMPLETION, "prompt": "x" * 2000}
    async with rig.http.post(f"{url}/v1/completions", json=big, headers=_keep(rig)) as resp:
        assert resp.status == 413
        assert "1000 bytes" in (await _error(resp))["message"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(3):
            yield b"x" * 600

    async with rig.http.post(f"{url}/v1/completions", data=chunked()) as resp:
        assert resp.status == 413
        await _error(resp)
    async with rig.http.post(f"{url}/v1/completions", data=b"{not json", headers=_keep(rig)) as resp:
        assert resp.status == 400
        assert (await _error(resp))["code"] == "invalid_request"
    async with rig.http.post(f"{url}/v1/chat/completions", data=b"[1, 2]") as resp:
        assert resp.status == 400
        await _error(resp)
    assert rig.prefill.seen == [] and rig.decode.seen == []


# ---------------------------------------------------------------------------------------------
# metrics, health, pass-through
# ---------------------------------------------------------------------------------------------
async def test_metrics_count_each_path(rig: Rig) -> None:
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=_keep(rig)) as resp:
        assert resp.status == 200
    deflect = {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512"}
    for _ in range(2):
        async with rig.http.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}, headers=deflect) as resp:
            await resp.read()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION) as resp:
        await resp.read()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers={c.H_ROUTE: "keep"}) as resp:
        assert resp.status == 502
    async with rig.http.get(f"{url}/kairos/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert _metric(text, "kairos_sidecar_hop1_seconds_count", path="keep") == 1
    assert _metric(text, "kairos_sidecar_hop1_seconds_sum", path="keep") > 0
    assert _metric(text, "kairos_sidecar_hop_errors_total", hop="1", kind="bad_routing_headers") == 1
    # A TTFT (and its local hop's TTFB) for the streams only; every other request is counted without.
    for path, streams in (("keep", 0), ("deflect", 2), ("local", 0)):
        assert _metric(text, "kairos_sidecar_ttfb_seconds_count", path=path) == streams
        assert _metric(text, "kairos_sidecar_ttft_seconds_count", path=path) == streams
    unobserved = "kairos_sidecar_ttft_unobserved_total"
    assert _metric(text, unobserved, path="keep", reason="not_streamed") == 1
    assert _metric(text, unobserved, path="keep", reason="error") == 1  # the 502
    assert _metric(text, unobserved, path="local", reason="not_streamed") == 1
    assert _metric(text, unobserved, path="deflect", reason="not_streamed") == 0


async def test_the_node_agents_probe_is_answered_by_the_sidecar_alone(rig: Rig) -> None:
    """The heartbeat publisher's probe gets an empty 204 from the sidecar's own loop: no vLLM is
    asked and no metrics page rendered (a 200 with a body would be one of those)."""
    url = await rig.start_sidecar()
    async with rig.http.get(f"{url}{c.SIDECAR_PROBE_PATH}") as resp:
        assert (resp.status, await resp.read()) == (204, b"")
    await SidecarProbe(url.removeprefix("http://")).check()
    assert rig.decode.seen == rig.prefill.seen == []


async def test_observed_ttft_over_the_dispatchers_prediction(rig: Rig) -> None:
    url = await rig.start_sidecar()
    # A prediction of 1 µs: whatever the fake takes is far more, so the ratio lands in +Inf.
    headers = {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "512", c.H_PRED_TTFT_DECODE_MS: "0.001"}
    stream = {**COMPLETION, "stream": True}
    async with rig.http.post(f"{url}/v1/completions", json=stream, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
    async with rig.http.post(
        f"{url}/v1/completions", json=stream, headers={**headers, c.H_PRED_TTFT_DECODE_MS: "not a number"}
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 200  # not streamed: no TTFT, so no ratio
    async with rig.http.get(f"{url}/kairos/metrics") as resp:
        text = await resp.text()
    name = "kairos_sidecar_ttft_observed_over_predicted"
    assert _metric(text, f"{name}_count", path="deflect") == 1  # the unparsable prediction is skipped
    assert _metric(text, f"{name}_bucket", le="8.0", path="deflect") == 0
    assert _metric(text, f"{name}_sum", path="deflect") > 8


async def test_health_reflects_the_local_vllm(rig: Rig) -> None:
    url = await rig.start_sidecar()
    async with rig.http.get(f"{url}/health") as resp:
        assert resp.status == 200
    rig.decode.health_status = 500
    async with rig.http.get(f"{url}/health") as resp:
        assert resp.status == 503
    dead_url = await rig.start_sidecar(local_vllm=_dead_port())
    async with rig.http.get(f"{dead_url}/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "unhealthy"


async def test_the_public_api_is_proxied_to_the_local_vllm_and_nothing_else(rig: Rig) -> None:
    url = await rig.start_sidecar()
    async with rig.http.get(f"{url}/v1/models", headers={"x-kairos-route": "keep"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "tiny"
    async with rig.http.post(f"{url}/tokenize", json={"prompt": "hi"}) as resp:
        assert resp.status == 200 and (await resp.json())["count"] == 1
    assert [s.path for s in rig.decode.seen] == ["/v1/models", "/tokenize"]
    assert rig.decode.seen[1].json == {"prompt": "hi"}
    assert not [h for h in rig.decode.seen[0].headers if h.startswith(c.HEADER_PREFIX)]
    # The node's internal endpoints live on its own port only: JSON 404s here, never relayed.
    for method, path in (("GET", "/metrics"), ("GET", c.STATE_PATH), ("PUT", "/kairos/kv/pull"), ("GET", "/x")):
        async with rig.http.request(method, f"{url}{path}") as resp:
            assert resp.status == 404, path
            assert (await _error(resp))["code"] == "not_found"
    async with rig.http.post(f"{url}/v1/models", json={}) as resp:
        assert resp.status == 405
        assert (await _error(resp))["code"] == "method_not_allowed"
    assert len(rig.decode.seen) == 2


@pytest.mark.parametrize("route", ["local", "keep", "deflect"])
async def test_client_sent_kv_transfer_params_never_reach_a_node(rig: Rig, route: str) -> None:
    url = await rig.start_sidecar()
    forged = {"do_remote_prefill": True, "remote_engine_id": "evil", "remote_host": "10.9.9.9", "remote_port": 1}
    headers = {"local": {}, "keep": _keep(rig), "deflect": {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "256"}}[route]
    async with rig.http.post(
        f"{url}/v1/completions", json={**COMPLETION, "kv_transfer_params": forged}, headers=headers
    ) as resp:
        assert resp.status == 200, await resp.text()
    (seen,) = rig.decode.seen
    # keep: only the prefill node's own params reach the decode node (and the sidecar's reach P)
    assert seen.json.get("kv_transfer_params") == (PREFILL_KV if route == "keep" else None)
    assert [s.json["kv_transfer_params"] for s in rig.prefill.seen] == (
        [dict(HOP1_KV_TRANSFER_PARAMS)] if route == "keep" else []
    )


@pytest.mark.parametrize("route", ["keep", "deflect"])
async def test_values_orjson_cannot_write_reach_the_nodes_as_sent(rig: Rig, route: str) -> None:
    """The hops' bodies are written with orjson where it can: NaN, infinities (it would write
    null), integers past 64 bits and escaped surrogate pairs still reach the nodes as they came."""
    url = await rig.start_sidecar()
    raw = (
        b'{"model": "tiny", "prompt": "hi \\ud83d\\ude00", "max_tokens": 3, "temperature": NaN, '
        b'"top_p": Infinity, "seed": 123456789012345678901234567890}'
    )
    headers = {
        **(_keep(rig) if route == "keep" else {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "256"}),
        "Content-Type": "application/json",
    }
    async with rig.http.post(f"{url}/v1/completions", data=raw, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    hops = [*rig.prefill.seen, *rig.decode.seen]
    assert len(hops) == (2 if route == "keep" else 1)
    for seen in hops:
        assert b'"temperature":NaN' in seen.raw and b'"top_p":Infinity' in seen.raw
        body = seen.json
        assert body["seed"] == 123456789012345678901234567890
        assert body["prompt"] == "hi \U0001f600"


@pytest.mark.parametrize(
    ("raw", "headers", "status", "code"),
    [
        pytest.param(
            b'{"prompt": "x"}',
            {"Content-Encoding": "gzip"},
            415,
            "unsupported_content_encoding",
            id="plain body labelled gzip",
        ),
        pytest.param(
            b"\x1f\x8b\x08\x00", {"Content-Encoding": "gzip"}, 415, "unsupported_content_encoding", id="gzip body"
        ),
        pytest.param(b'{"prompt": "x"}', {"Content-Encoding": "br"}, 415, "unsupported_content_encoding", id="br"),
        pytest.param(b'{"prompt": "x", "user": "\xed\xa0\x80"}', {}, 400, "invalid_request", id="raw surrogate bytes"),
        pytest.param(b'{"prompt": "x", "user": "\\ud800"}', {}, 400, "invalid_request", id="escaped lone surrogate"),
    ],
)
async def test_undecodable_bodies_are_4xx_never_500(
    rig: Rig, raw: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    url = await rig.start_sidecar()
    for route_headers in ({}, _keep(rig), {c.H_ROUTE: "deflect", c.H_CHUNK_SCHEDULE: "256"}):
        async with rig.http.post(
            f"{url}/v1/completions", data=raw, headers={"Content-Type": "application/json", **headers, **route_headers}
        ) as resp:
            assert resp.status == status, await resp.text()
            assert (await _error(resp))["code"] == code
    assert rig.prefill.seen == [] and rig.decode.seen == []


# ---------------------------------------------------------------------------------------------
# TTFT feedback to Redis
# ---------------------------------------------------------------------------------------------
async def _feedback_entries(url: str) -> list[dict[str, str]]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return [fields for _id, fields in await client.xrange(c.REDIS_TTFT_FEEDBACK_STREAM)]
    finally:
        await client.aclose()


async def _sidecar_metrics(rig: Rig, url: str) -> str:
    async with rig.http.get(f"{url}/kairos/metrics") as resp:
        return await resp.text()


DEFLECT_PREDICTED = {
    c.H_ROUTE: "deflect",
    c.H_CHUNK_SCHEDULE: "512",
    c.H_PRED_TTFT_DECODE_MS: "250.0",
    c.H_PRED_TTFT_PREFILL_MS: "900.0",  # the other path's prediction: not this path's
    c.H_DECODE_NODE: "d7",
}


async def test_ttft_feedback_is_one_xadd_per_routed_request_after_its_first_token(rig: Rig, redis: RedisServer) -> None:
    url = await rig.start_sidecar(redis_url=redis.url)
    rig.decode.use_gate = True  # the stream holds after its first event until the gate opens
    body = {**COMPLETION, "stream": True}
    headers = {**DEFLECT_PREDICTED, c.H_REQUEST_ID: "req-deflect"}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token
        # Sent while the response is still streaming: after the first token, not at the end.
        (entry,) = await eventually(lambda: _feedback_entries(redis.url))
        rig.decode.gate.set()
        await resp.read()
    assert set(entry) == set(c.TtftFeedbackField.ALL)
    assert {k: entry[k] for k in ("request_id", "path", "node", "predicted_ms", "measured")} == {
        "request_id": "req-deflect",
        "path": "deflect",
        "node": "d7",
        "predicted_ms": "250.000",
        "measured": "first_token",
    }
    assert float(entry["observed_ms"]) > 0

    keep = _keep(rig, **{c.H_PRED_TTFT_PREFILL_MS: "120.5", c.H_REQUEST_ID: "req-keep"})
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=keep) as resp:
        assert resp.status == 200
        await resp.read()
    # No sample without a prediction, nor for a request that did not come through the gateway,
    # nor for a non-streamed one (its first token is not visible here).
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=_keep(rig)) as resp:
        assert resp.status == 200
        await resp.read()
    async with rig.http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
    plain = {**DEFLECT_PREDICTED, c.H_REQUEST_ID: "req-plain"}
    async with rig.http.post(f"{url}/v1/completions", json=COMPLETION, headers=plain) as resp:
        assert resp.status == 200

    # A marker with a prediction, after them: the one writer XADDs in offer order, and a sample is
    # offered before its first token is relayed, so once the marker is in the stream a wrong sample
    # for the requests above would be there too.
    marker = {**DEFLECT_PREDICTED, c.H_REQUEST_ID: "req-marker"}
    async with rig.http.post(f"{url}/v1/completions", json=body, headers=marker) as resp:
        assert resp.status == 200
        await resp.read()

    async def up_to_the_marker() -> list[dict[str, str]] | None:
        entries = await _feedback_entries(redis.url)
        return entries if entries and entries[-1]["request_id"] == "req-marker" else None

    entries = await eventually(up_to_the_marker, what="the marker's feedback sample")
    assert [(e["request_id"], e["path"], e["predicted_ms"]) for e in entries] == [
        ("req-deflect", "deflect", "250.000"),
        ("req-keep", "keep", "120.500"),
        ("req-marker", "deflect", "250.000"),
    ]
    assert entries[1]["node"] == rig.decode.url  # no decode node header: the local vLLM names it

    async def counted() -> str | None:  # the writer counts "sent" once XADD's reply is back: just after
        text = await _sidecar_metrics(rig, url)
        return text if _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="sent") >= 3 else None

    text = await eventually(counted, what="3 samples counted sent")
    assert _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="sent") == 3
    assert _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="error") == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@dataclass(frozen=True)
class NodeTiming:
    """One request as the node timed it (wall seconds from its arrival there)."""

    first_token_s: float
    last_token_s: float


async def _node_timing(http: aiohttp.ClientSession, url: str, scale: float) -> NodeTiming:
    """The node's own TTFT and TTFT + decode span, summed over every request so far: the emulated
    vLLM's vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds (model seconds)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    sums = {
        line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("vllm:time_to_first_token_seconds_sum{", "vllm:inter_token_latency_seconds_sum{"))
    }
    ttft = sums["vllm:time_to_first_token_seconds_sum"] / scale
    span = sums["vllm:inter_token_latency_seconds_sum"] / scale
    return NodeTiming(ttft, ttft + span)


async def test_a_ttft_sample_is_the_nodes_first_token_never_the_whole_response(
    rig: Rig, redis: RedisServer, model_dir: Path
) -> None:
    """Every TTFT the sidecar reports (feedback sample and histogram) lands at the node's own first
    token: after it (the sidecar saw the request first), and nearer to it than to the last token.
    A non-streamed response's first byte comes after the last token: that request has no sample
    and is counted as not streamed instead."""
    # Model seconds per wall second: the 80 decode steps take about 1.8 s of wall time, so the
    # midway bound leaves the sidecar's hops some 0.9 s on a starved machine.
    scale = 2.0
    node_config = EmulatedNodeConfig(node_id="d0", role=c.Role.DECODE, model_dir=str(model_dir), model="tiny")
    runner, node = await _serve(emulated_node(dataclasses.replace(node_config, time_scale=scale)))
    try:
        url = await rig.start_sidecar(local_vllm=node, redis_url=redis.url)
        prompt = [10 + i for i in range(1000)]
        headers = {**DEFLECT_PREDICTED, c.H_CHUNK_SCHEDULE: "1000", c.H_DECODE_NODE: "d0"}
        timings: dict[str, NodeTiming] = {}
        seen = NodeTiming(0.0, 0.0)
        for rid, stream in (("plain", False), ("streamed", True)):  # one at a time: the node's sums are theirs
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 80, "stream": stream}
            async with rig.http.post(
                f"{url}/v1/completions", json=body, headers={**headers, c.H_REQUEST_ID: rid}
            ) as resp:
                assert resp.status == 200
                await resp.read()
            total = await _node_timing(rig.http, f"http://{node}", scale)
            timings[rid] = NodeTiming(total.first_token_s - seen.first_token_s, total.last_token_s - seen.last_token_s)
            seen = total

        async def up_to_the_stream() -> list[dict[str, str]] | None:  # the writer sends in offer order
            entries = await _feedback_entries(redis.url)
            return entries if entries and entries[-1]["request_id"] == "streamed" else None

        entries = {e["request_id"]: e for e in await eventually(up_to_the_stream, what="the streamed sample")}
        for rid, entry in entries.items():
            observed, node_timing = float(entry["observed_ms"]) / 1e3, timings[rid]
            midway = (node_timing.first_token_s + node_timing.last_token_s) / 2
            assert node_timing.first_token_s - 0.001 <= observed < midway, (
                f"{rid}: the sidecar reported {observed:.3f} s as its TTFT; the node's first token came at "
                f"{node_timing.first_token_s:.3f} s, its last at {node_timing.last_token_s:.3f} s"
            )
            assert entry[c.TtftFeedbackField.MEASURED] == c.TTFT_FEEDBACK_FIRST_TOKEN
        assert list(entries) == ["streamed"]

        text = await _sidecar_metrics(rig, url)
        assert _metric(text, "kairos_sidecar_ttft_seconds_count", path="deflect") == 1
        ttft = _metric(text, "kairos_sidecar_ttft_seconds_sum", path="deflect")
        streamed = timings["streamed"]
        assert streamed.first_token_s - 0.001 <= ttft < (streamed.first_token_s + streamed.last_token_s) / 2
        assert _metric(text, "kairos_sidecar_ttft_unobserved_total", path="deflect", reason="not_streamed") == 1
    finally:
        await runner.cleanup()


async def test_ttft_feedback_without_a_redis_url_uses_no_redis(rig: Rig, redis: RedisServer) -> None:
    url = await rig.start_sidecar()
    async with rig.http.post(f"{url}/v1/completions", json=STREAMED, headers=DEFLECT_PREDICTED) as resp:
        assert resp.status == 200
        await resp.read()
    # No wait: a sample is offered at the stream's first event, so the sidecar had its chance.
    assert await _feedback_entries(redis.url) == []
    assert _metric(await _sidecar_metrics(rig, url), "kairos_sidecar_ttft_feedback_total", outcome="sent") == 0


async def test_a_redis_that_never_answers_never_delays_a_request(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis that accepts connections and never replies: each XADD would wait the full (here
    10 s) timeout; requests must not notice."""
    monkeypatch.setattr(sidecar_app, "FEEDBACK_TIMEOUT_S", 10.0)
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = await rig.start_sidecar(redis_url=f"redis://127.0.0.1:{port}/0")
        for _ in range(3):
            async with asyncio.timeout(2.0):
                async with rig.http.post(f"{url}/v1/completions", json=STREAMED, headers=DEFLECT_PREDICTED) as r:
                    assert r.status == 200
                    await r.read()
        # The writer did try (it lets samples gather for _FEEDBACK_LINGER_S first).
        assert await eventually(lambda: held, what="the writer's connection")
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_redis_down_is_counted_logged_once_and_recovers(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sidecar_app, "FEEDBACK_RETRY_S", 0.2)
    # The first sample after the restart must get through: a busy CI machine once took longer
    # than the default 0.25 s bound to connect, and that sample was (rightly) lost.
    monkeypatch.setattr(sidecar_app, "FEEDBACK_TIMEOUT_S", 5.0)
    caplog.set_level(logging.INFO, logger="kairos.nodeagent.sidecar")
    server = RedisServer()  # its port; not started yet: Redis is down
    try:
        url = await rig.start_sidecar(redis_url=server.url)
        for _ in range(4):
            async with rig.http.post(f"{url}/v1/completions", json=STREAMED, headers=DEFLECT_PREDICTED) as resp:
                assert resp.status == 200
                await resp.read()
        text = await eventually(lambda: _errors_seen(rig, url))
        assert _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="sent") == 0
        down = [r for r in caplog.records if "TTFT feedback: redis at" in r.getMessage() and "failed" in r.getMessage()]
        assert len(down) == 1 and down[0].levelno == logging.WARNING
        assert "requests are not affected" in down[0].getMessage()

        server.start()
        # The pause is 0.2 s of loop time from the last failure, which came before _errors_seen saw
        # all 4 samples counted; a sleep lasts at least its 0.25 s of loop time, so this is a
        # deadline the sleep cannot miss, however slow the machine (slower only sleeps longer).
        await asyncio.sleep(0.25)
        async with rig.http.post(f"{url}/v1/completions", json=STREAMED, headers=DEFLECT_PREDICTED) as resp:
            assert resp.status == 200
            await resp.read()

        async def sent() -> str | None:  # counted and logged ("answers again") once XADD's reply is back
            text = await _sidecar_metrics(rig, url)
            return text if _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="sent") >= 1 else None

        text = await eventually(sent, what="the first sample after the restart sent")
        assert len(await _feedback_entries(server.url)) == 1
        lost = sum(_metric(text, "kairos_sidecar_ttft_feedback_total", outcome=o) for o in ("error", "dropped"))
        assert lost == 4 and _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="sent") == 1
        back = [r for r in caplog.records if "answers again" in r.getMessage()]
        assert len(back) == 1 and "4 samples were lost" in back[0].getMessage()
        assert len([r for r in caplog.records if "TTFT feedback: redis at" in r.getMessage()]) == 2
    finally:
        server.close()


async def _errors_seen(rig: Rig, url: str) -> str | None:
    text = await _sidecar_metrics(rig, url)
    errors = _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="error")
    dropped = _metric(text, "kairos_sidecar_ttft_feedback_total", outcome="dropped")
    return text if errors >= 1 and errors + dropped == 4 else None


async def test_a_full_feedback_queue_drops_the_sample() -> None:
    metrics = SidecarMetrics()
    publisher = TtftFeedbackPublisher("redis://127.0.0.1:1/0", metrics, queue_size=1)  # never started
    publisher.offer("a", "keep", "d0", 0.1, 0.2)
    publisher.offer("b", "keep", "d0", 0.1, 0.2)
    assert metrics.registry.get_sample_value("kairos_sidecar_ttft_feedback_total", {"outcome": "dropped"}) == 1


# ---------------------------------------------------------------------------------------------
# config and CLI
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"local_vllm": "http://127.0.0.1:8101"}, "local_vllm"),
        ({"allowed_prefill_hosts": ("127.0.0.1",)}, "allowed_prefill_hosts"),
        ({"port": 70000}, "port"),
        ({"hop1_timeout_s": 0.0}, "hop1_timeout_s"),
        ({"hop1_connect_timeout_s": 5.0, "hop1_timeout_s": 2.0}, "must not exceed"),
        ({"hop2_timeout_s": float("nan")}, "hop2_timeout_s"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"redis_url": "127.0.0.1:6379"}, "redis_url"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SidecarConfig(**overrides)


def test_config_normalises_hosts() -> None:
    cfg = SidecarConfig(local_vllm=" LocalHost:8101", allowed_prefill_hosts=("A.example:1", "a.example:1"))
    assert cfg.local_vllm == "localhost:8101"
    assert cfg.allowed_prefill_hosts == ("a.example:1",)


def test_cli_listens_and_stops_cleanly_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "kairos.nodeagent.sidecar",
        "--port",
        "0",
        "--local-vllm",
        "127.0.0.1:8101",
        "--allow-prefill",
        "127.0.0.1:8001,127.0.0.1:8002",
    ]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = proc.stdout.readline()
            assert line.startswith("listening on 127.0.0.1:"), proc.stderr.read()
            port = int(line.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert "stopping" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
