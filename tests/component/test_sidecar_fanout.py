"""The sidecar's fan-out of a batch (kairos.nodeagent.fanout), over real HTTP on 127.0.0.1: each
prompt goes back through a stand-in gateway (which serves it on an emulated vLLM node, as Envoy
would route it to a sidecar), and the answers are merged into the one answer the node itself
gives the whole batch. A part that fails makes the batch's answer, as in vLLM; the rest are
abandoned. Also: a keep request's hop 1 prefills once whatever the client's n."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.launcher.tinymodel import build_tiny_model
from kairos.nodeagent.sidecar import SidecarConfig, app_runner
from kairos.sim.emulated_vllm import EmulatedNodeConfig
from kairos.sim.emulated_vllm import app_runner as emulated_node
from tests.waiting import eventually

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@dataclass
class Gateway:
    """Stands in for Envoy and the sidecars behind it: serves each part on the emulated node,
    recording what came, naming a route per part, and failing the parts a test names."""

    node: str  # host:port of the emulated vLLM node
    seen: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    fail: dict[int, int] = field(default_factory=dict)  # part -> status answered before any byte
    error_after: dict[int, int] = field(default_factory=dict)  # part -> chunks before an error event
    cut_after: dict[int, int] = field(default_factory=dict)  # part -> chunks before the connection drops
    hold: set[int] = field(default_factory=set)  # parts whose answer waits until abandoned
    abandoned: set[int] = field(default_factory=set)  # parts whose client (the sidecar) left
    url: str = ""

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(({k.lower(): v for k, v in request.headers.items()}, body))
        part = int(request.headers[c.H_REQUEST_ID].rsplit("-", 1)[1])
        route = {c.H_ROUTE: "keep" if part % 2 == 0 else "deflect"}
        if part in self.fail:
            error = {"error": {"message": f"part {part} failed", "type": "server_error", "param": None, "code": None}}
            return web.json_response(error, status=self.fail[part], headers=route)
        if part in self.hold:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.abandoned.add(part)
                raise
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{self.node}{request.path}", json=body, headers={c.H_REQUEST_ID: "node"}) as answer,
        ):
            if not body.get("stream"):
                return web.Response(body=await answer.read(), headers={"Content-Type": "application/json", **route})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **route})
            await out.prepare(request)
            chunks = 0
            async for event in answer.content.iter_chunked(1 << 16):
                for piece in event.split(b"\n\n"):
                    if not piece:
                        continue
                    if chunks == self.error_after.get(part):
                        error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
                        await out.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
                        return out
                    if chunks == self.cut_after.get(part):
                        assert request.transport is not None
                        request.transport.close()
                        return out
                    await out.write(piece + b"\n\n")
                    chunks += 1
            await out.write_eof()
            return out


@dataclass
class Rig:
    gateway: Gateway
    node: str
    sidecar: str  # base URL
    http: aiohttp.ClientSession
    start_sidecar: Callable[..., Awaitable[str]]

    async def post(self, body: dict[str, Any], rid: str = "b1") -> aiohttp.ClientResponse:
        headers = {c.H_ROUTE: c.ROUTE_FANOUT, c.H_REQUEST_ID: rid, c.H_PROMPT_TOKENS: "30"}
        return await self.http.post(f"{self.sidecar}/v1/completions", json=body, headers=headers)


async def _serve(app: web.Application | web.AppRunner) -> tuple[web.AppRunner, str]:
    runner = app if isinstance(app, web.AppRunner) else web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"{host}:{port}"


@pytest.fixture
async def rig(model_dir: Path) -> AsyncIterator[Rig]:
    config = EmulatedNodeConfig(node_id="d0", role=Role.DECODE, model_dir=str(model_dir), model=MODEL, time_scale=20)
    runners = []
    runner, node = await _serve(emulated_node(config))
    runners.append(runner)
    gateway = Gateway(node)
    app = web.Application()
    app.router.add_post("/v1/completions", gateway.completion)
    app.router.add_post("/v1/chat/completions", gateway.completion)
    runner, gateway.url = await _serve(app)
    runners.append(runner)

    async def start_sidecar(**overrides: Any) -> str:
        settings = {"port": 0, "local_vllm": node, "gateway": gateway.url, "hop2_timeout_s": 5.0, **overrides}
        runner, url = await _serve(app_runner(SidecarConfig(**settings), shutdown_timeout=0.1))
        runners.append(runner)
        return f"http://{url}"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        yield Rig(gateway, node, await start_sidecar(), http, start_sidecar)
    for runner in reversed(runners):
        await runner.cleanup()


async def node_answer(rig: Rig, body: dict[str, Any], rid: str) -> bytes:
    """The emulated node's own answer to the whole batch."""
    async with rig.http.post(f"http://{rig.node}/v1/completions", json=body, headers={c.H_REQUEST_ID: rid}) as r:
        assert r.status == 200
        return await r.read()


def events(raw: bytes) -> list[Any]:
    out = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in out]


def without_created(obj: Any) -> Any:
    return {k: v for k, v in obj.items() if k != "created"} if isinstance(obj, dict) else obj


PROMPTS = [[5] * 10, [6] * 20, [7] * 30]


async def test_a_batchs_prompts_and_choices_go_through_the_gateway_one_each_and_merge_as_the_node_answers(
    rig: Rig,
) -> None:
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "n": 2, "temperature": 0.5, "seed": 11}
    resp = await rig.post(body, rid="b1")
    assert resp.status == 200, await resp.text()
    merged = await resp.json()
    assert (resp.headers[c.H_ROUTE], resp.headers[c.H_REQUEST_ID]) == (c.ROUTE_FANOUT, "b1")
    assert without_created(merged) == without_created(json.loads(await node_answer(rig, body, "b1")))
    assert [ch["index"] for ch in merged["choices"]] == list(range(6))
    assert merged["usage"]["prompt_tokens"] == 60 and merged["usage"]["completion_tokens"] == 18
    # One request per prompt and choice, as vLLM's engine requests (prompt p's choice j is part
    # p * 2 + j): the body with that one prompt, n 1 and the choice's seed, as a client would send
    # it (no routing header).
    parts = sorted(rig.gateway.seen, key=lambda s: s[0][c.H_REQUEST_ID])
    assert [h[c.H_REQUEST_ID] for h, _ in parts] == [f"b1-{i}" for i in range(6)]
    assert [p for _, p in parts] == [{**body, "prompt": p, "n": 1, "seed": 11 + j} for p in PROMPTS for j in (0, 1)]
    assert not any(name.startswith(c.HEADER_PREFIX) for h, _ in parts for name in h)


async def test_n_choices_of_one_prompt_and_of_a_chat_go_through_the_gateway_one_each(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": 2, "n": 3}
    resp = await rig.post(body, rid="n1")
    merged = await resp.json()
    assert without_created(merged) == without_created(json.loads(await node_answer(rig, body, "n1")))
    assert [p for _, p in sorted(rig.gateway.seen, key=lambda s: s[0][c.H_REQUEST_ID])] == [{**body, "n": 1}] * 3
    assert merged["usage"]["prompt_tokens"] == merged["usage"]["total_tokens"] - 6  # the prompt once

    rig.gateway.seen.clear()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    headers = {c.H_ROUTE: c.ROUTE_FANOUT, c.H_REQUEST_ID: "c1"}
    async with rig.http.post(f"{rig.sidecar}/v1/chat/completions", json=chat, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    assert answer["id"] == "chatcmpl-c1" and answer["object"] == "chat.completion"
    assert [ch["index"] for ch in answer["choices"]] == [0, 1]
    assert [p for _, p in rig.gateway.seen] == [{**chat, "n": 1}] * 2


async def test_a_streamed_batch_relays_each_prompts_chunks_with_batch_indices_one_usage_and_one_done(
    rig: Rig,
) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await rig.post(body, rid="s1")
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    got = events(await resp.read())
    want = events(await node_answer(rig, body, "s1"))
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert without_created(got[-2]) == without_created(want[-2])  # the usage chunk: sums, as the node's
    chunks = [without_created(e) for e in got[:-2]]
    expected = [without_created(e) for e in want[:-2]]
    key = lambda e: (e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"])  # noqa: E731
    assert sorted(map(key, chunks)) == sorted(map(key, expected))  # the order of prompts interleaving may differ
    assert Counter(e["choices"][0]["index"] for e in chunks) == {0: 4, 1: 4, 2: 4}  # prompt i's one choice is i
    assert got[-2]["usage"]["prompt_tokens"] == 60 and got[-2]["usage"]["completion_tokens"] == 12
    assert all(list(a) == list(b) for a, b in zip(chunks, expected, strict=True))  # vLLM's field order


@pytest.mark.parametrize(("flag", "content_type"), [("true", "text/event-stream"), ("no", "application/json")])
async def test_a_batchs_stream_flag_is_read_as_vllm_reads_it(rig: Rig, flag: str, content_type: str) -> None:
    """vLLM's schema reads "true" as true and "no" as false: the batch streams (or not) as a node would."""
    resp = await rig.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": 2, "stream": flag})
    assert resp.status == 200 and resp.content_type == content_type
    body = await resp.read()
    if content_type == "text/event-stream":
        assert events(body)[-1] == "[DONE]"
    else:
        assert [ch["index"] for ch in json.loads(body)["choices"]] == [0, 1, 2]


async def test_a_part_refused_before_its_answer_is_the_batchs_answer_and_the_others_are_abandoned(
    rig: Rig,
) -> None:
    rig.gateway.fail = {1: 503}
    rig.gateway.hold = {0, 2}
    for stream in (False, True):
        rig.gateway.abandoned.clear()
        resp = await rig.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": 2, "stream": stream})
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "part 1 failed"

        async def abandoned() -> bool:
            return rig.gateway.abandoned == {0, 2}

        await eventually(abandoned, what="the other parts' requests closed")


async def test_a_part_failing_mid_stream_ends_the_batchs_stream_with_its_error_then_done(rig: Rig) -> None:
    rig.gateway.error_after = {2: 1}
    resp = await rig.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": 5, "stream": True})
    got = events(await resp.read())
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert got[-2]["error"]["message"] == "engine died"
    assert all("choices" in e for e in got[:-2])


async def test_a_part_cut_mid_stream_ends_the_batchs_stream_with_an_error_event(rig: Rig) -> None:
    rig.gateway.cut_after = {0: 2}
    resp = await rig.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": 5, "stream": True})
    got = events(await resp.read())
    assert got[-1] == "[DONE]"
    assert got[-2]["error"]["code"] == "upstream_error" and "part 0 of the request" in got[-2]["error"]["message"]


async def test_a_client_leaving_a_streamed_batch_abandons_its_parts(rig: Rig) -> None:
    rig.gateway.hold = {1}
    resp = await rig.post({"model": MODEL, "prompt": [[5] * 10, [6] * 10], "max_tokens": 2, "stream": True})
    resp.close()  # before the held part's head: the sidecar is still opening the parts

    async def abandoned() -> bool:
        return rig.gateway.abandoned == {1}

    await eventually(abandoned, what="the held part's request closed")


async def test_a_sidecar_without_a_gateway_answers_a_batch_502(rig: Rig) -> None:
    rig.sidecar = await rig.start_sidecar(gateway="")
    resp = await rig.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": 2})
    assert resp.status == 502
    assert "--gateway" in (await resp.json())["error"]["message"]
    assert rig.gateway.seen == []


async def test_a_keep_requests_hop_1_prefills_once_whatever_its_n(model_dir: Path) -> None:
    """vLLM's prefill node would run n child prefills and hold n copies of the KV, one of them
    ever read; the sidecar asks it for one. The decode node's n choices all read that one."""
    common = {"model_dir": str(model_dir), "model": MODEL, "time_scale": 20}
    p_runner, prefill = await _serve(emulated_node(EmulatedNodeConfig(node_id="p0", role=Role.PREFILL, **common)))
    d_runner, decode = await _serve(emulated_node(EmulatedNodeConfig(node_id="d0", role=Role.DECODE, **common)))
    config = SidecarConfig(port=0, local_vllm=decode, allowed_prefill_hosts=(prefill,))
    s_runner, sidecar = await _serve(app_runner(config, shutdown_timeout=0.1))
    try:
        async with aiohttp.ClientSession() as http:
            headers = {c.H_ROUTE: "keep", c.H_PREFILL_HOST: prefill, c.H_REQUEST_ID: "k1"}
            body = {"model": MODEL, "prompt": [9] * 40, "max_tokens": 3, "n": 3, "temperature": 1.0}
            async with http.post(f"http://{sidecar}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
            assert out["usage"]["completion_tokens"] == 9
            async with http.get(f"http://{prefill}/kairos/steps?since=0") as steps:
                prefilled = [ch["request_id"] for s in (await steps.json())["steps"] for ch in s["chunks"]]
            assert prefilled == ["k1"]  # one prefill (n 1), not "0_k1", "1_k1", "2_k1"
    finally:
        for runner in (s_runner, d_runner, p_runner):
            await runner.cleanup()
