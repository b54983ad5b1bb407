"""The emulated vLLM node over real HTTP on 127.0.0.1: vLLM's OpenAI API (through the openai SDK),
the P/D two-hop protocol, deflected chunk schedules, state/metrics, errors and the time scale."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import defaults
from kairos.common.config import load_config
from kairos.common.contracts import STEP_BUDGET_OVERRUNS_METRIC, Role
from kairos.common.errors import ConfigError
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.emulated_vllm import NODE_KEY, EmulatedNode, EmulatedNodeConfig, app_runner
from kairos.sim.engine import Engine, EngineConfig
from kairos.sim.engine import Sequence as Seq
from kairos.sim.realtime import EngineStoppedError, RealtimeEngine
from tests.waiting import eventually

MODEL = "tiny-llama"
SCALE = 20.0  # model seconds per wall second: a ~50 ms decode step takes ~2.5 ms
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


@dataclass
class Node:
    url: str
    node: EmulatedNode

    @property
    def host_port(self) -> str:
        return self.url.removeprefix("http://")


@asynccontextmanager
async def running(model_dir: Path, node_id: str, role: Role, **overrides: Any) -> AsyncIterator[Node]:
    settings: dict[str, Any] = {"model": MODEL, "time_scale": SCALE, **overrides}
    runner = app_runner(EmulatedNodeConfig(node_id=node_id, role=role, model_dir=str(model_dir), **settings))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield Node(f"http://127.0.0.1:{runner.addresses[0][1]}", runner.app[NODE_KEY])
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
async def decode(model_dir: Path) -> AsyncIterator[Node]:
    async with running(model_dir, "d0", Role.DECODE) as node:
        yield node


@pytest.fixture
async def prefill(model_dir: Path) -> AsyncIterator[Node]:
    async with running(model_dir, "p0", Role.PREFILL) as node:
        yield node


async def post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.json(content_type=None)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prometheus samples by full name with labels, e.g. 'vllm:num_requests_running{...}'."""
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    want = {"engine": "0", "model_name": MODEL, **labels}
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(want.items())) + "}"
    return samples[key]


def ids(n: int) -> list[int]:
    """A prompt of exactly ``n`` tokens (token ids are counted as given)."""
    return [10 + i % 2000 for i in range(n)]


def assert_openai_error(status: int, body: Any, expected_status: int) -> str:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]["message"]


# ---------------------------------------------------------------------------------------------
# OpenAI API through the SDK
# ---------------------------------------------------------------------------------------------
async def test_completions_and_chat_through_the_openai_sdk(decode: Node, tokenizer: PromptTokenizer) -> None:
    client = openai.AsyncOpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    prompt = "The gateway routes each request to a node that can serve it."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which node serves me?"}]
    prompt_n, chat_n = tokenizer.count_completion_prompt(prompt), tokenizer.count_chat_prompt(messages)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        done = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=7)
        assert done.id.startswith("cmpl-") and done.model == MODEL and done.object == "text_completion"
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_n, 7)
        assert done.usage.total_tokens == prompt_n + 7
        assert done.choices[0].finish_reason == "length" and len(done.choices[0].text.split()) == 7

        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        texts = [ch.choices[0].text for ch in chunks if ch.choices]
        assert len(texts) == 5 and all(t.strip() for t in texts)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices] == [None] * 4 + ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_n, 5)

        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_n, 4)
        assert len((chat.choices[0].message.content or "").split()) == 4

        chat_stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        deltas = [chunk async for chunk in chat_stream]
        assert deltas[0].choices[0].delta.role == "assistant" and deltas[0].choices[0].delta.content == ""
        contents = [d.choices[0].delta.content for d in deltas[1:] if d.choices]
        assert len(contents) == 6 and all(contents)
        assert [d.choices[0].finish_reason for d in deltas if d.choices][-1] == "length"
        usage = deltas[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (chat_n, 6)

        # The SDK surfaces the node's OpenAI error JSON as its typed exception.
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32768)
    finally:
        await client.close()


async def test_an_idle_kept_alive_connection_is_closed_as_vllm_closes_it(model_dir: Path) -> None:
    # vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): a client that
    # reuses connections must meet that close here too, not only against a real node.
    async with running(model_dir, "d9", Role.DECODE, keep_alive_timeout_s=1.1) as node:
        host, port = node.host_port.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {node.host_port}\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
            assert head.startswith(b"HTTP/1.1 200") and b"close" not in head.lower()  # kept alive
            length = int(
                next(
                    v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
                )
            )
            await reader.readexactly(length)
            assert await asyncio.wait_for(reader.read(1), 20) == b""  # then closed by the node
        finally:
            writer.close()
    with pytest.raises(ConfigError, match="keep_alive_timeout_s must be a number over 1 "):
        EmulatedNodeConfig(node_id="d9", role=Role.DECODE, model_dir=str(model_dir), keep_alive_timeout_s=1)


async def test_x_request_id_names_the_sequence_and_the_response(decode: Node, http: aiohttp.ClientSession) -> None:
    status, body = await post(
        http,
        f"{decode.url}/v1/completions",
        {"model": MODEL, "prompt": ids(20), "max_tokens": 2},
        **{"X-Request-Id": "r-1"},
    )
    assert status == 200 and body["id"] == "cmpl-r-1"
    steps = (await get_json(http, f"{decode.url}/kairos/steps?since=0"))["steps"]
    assert steps[0]["chunks"] == [{"request_id": "r-1", "tokens": 20, "cached": 0}]


# ---------------------------------------------------------------------------------------------
# P/D two-hop protocol
# ---------------------------------------------------------------------------------------------
async def test_two_hop_prefill_then_decode_pulls_the_kv(
    prefill: Node, decode: Node, http: aiohttp.ClientSession, tokenizer: PromptTokenizer
) -> None:
    prompt = "Disaggregated serving moves the KV cache from the prefill node to the decode node. " * 20
    n = tokenizer.count_completion_prompt(prompt)
    client_body = {"model": MODEL, "prompt": prompt, "max_tokens": 12}
    rid = {"X-Request-Id": "two-hop-1"}
    hop1 = {
        **client_body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None},
    }
    status, reply = await post(http, f"{prefill.url}/v1/completions", hop1, **rid)
    assert status == 200, reply
    assert reply["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 1,
        "total_tokens": n + 1,
        "prompt_tokens_details": None,
    }
    kv = reply["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False and kv["tp_size"] == 1
    assert kv["remote_engine_id"] == prefill.node.engine_id and kv["remote_num_tokens"] == n
    assert f"{kv['remote_host']}:{kv['remote_port']}" == prefill.host_port
    # vLLM 0.32's reply, key for key (pull_scheduler.request_finished, then the scheduler's hit).
    assert list(kv) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    assert (kv["dcp_size"], kv["pp_size"], kv["remote_blocks_expiry_time"], kv["transfer_mode"]) == (1, 1, None, "pull")
    (blocks,) = kv["remote_block_ids"]  # one KV cache group
    assert len(blocks) == -(-n // 16)
    # The prefill node holds the prompt's KV (and its one sampled token) until it is pulled.
    held = await get_json(http, f"{prefill.url}/kairos/state")
    assert held["kv_tokens"] == n + 1 and held["decode_tokens"] == 0

    status, done = await post(http, f"{decode.url}/v1/completions", {**client_body, "kv_transfer_params": kv}, **rid)
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == n and done["usage"]["completion_tokens"] == 12
    assert done["kv_transfer_params"] is None
    m = await metrics(http, decode.url)
    assert sample(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == n
    assert sample(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert sample(m, "vllm:generation_tokens_total") == 12
    # Each node counts the request it finished, as vLLM does: the prefill node its one-token hop 1
    # too, so a client's request count is the decode nodes' alone.
    assert sample(m, "vllm:request_success_total", finished_reason="length") == 1
    # The decode node never prefilled: every one of its steps is a decode step.
    steps = (await get_json(http, f"{decode.url}/kairos/steps"))["steps"]
    assert len(steps) == 12 and all(s["chunks"] == [] and s["decode_tokens"] == 1 for s in steps)
    pm = await metrics(http, prefill.url)
    assert sample(pm, "vllm:prompt_tokens_by_source_total", source="local_compute") == n
    assert sample(pm, "vllm:request_success_total", finished_reason="length") == 1

    async def released() -> bool:
        return (await get_json(http, f"{prefill.url}/kairos/state"))["kv_tokens"] == 0

    await eventually(released, what="the prefill node freed the pulled KV")  # once the modelled transfer was read
    # The same parameters again: the KV is gone, the client gets a clear 400 at once.
    status, again = await post(http, f"{decode.url}/v1/completions", {**client_body, "kv_transfer_params": kv})
    assert "does not hold" in assert_openai_error(status, again, 400)


async def test_concurrent_kv_pulls_queue_on_the_decode_nodes_link(model_dir: Path, http: aiohttp.ClientSession) -> None:
    """Like the simulator, a decode node has one inbound KV link: two pulls take twice as long
    as one, they do not overlap. (A slow time scale makes the transfer dominate the overheads.)"""
    async with (
        running(model_dir, "p9", Role.PREFILL, time_scale=2.0) as prefill,
        running(model_dir, "d9", Role.DECODE, time_scale=2.0) as decode,
    ):
        await _two_pulls(prefill, decode, http, time_scale=2.0)


async def test_the_state_reports_the_kv_pulls_the_decode_node_has_yet_to_finish(
    prefill: Node, decode: Node, http: aiohttp.ClientSession
) -> None:
    """While its link is held, a decode node's two pulls wait on it and its state lists their
    prompt tokens in arrival order (what the keep path's estimate queues behind); once they are
    done, none. A prefill node reports none at all."""
    params = []
    for i, n in enumerate((300, 200)):
        hop1 = {
            "model": MODEL,
            "prompt": ids(n),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1, **{"X-Request-Id": f"pull-{i}"})
        assert status == 200, reply
        params.append((n, reply["kv_transfer_params"]))
    assert "pending_kv_pull_tokens" not in await get_json(http, f"{prefill.url}/kairos/state")
    assert (await get_json(http, f"{decode.url}/kairos/state"))["pending_kv_pull_tokens"] == []
    hops: list[asyncio.Task[tuple[int, Any]]] = []
    async with decode.node._link:  # the link is busy: both pulls queue on it
        for i, (n, kv) in enumerate(params):
            body = {"model": MODEL, "prompt": ids(n), "max_tokens": 1, "kv_transfer_params": kv}
            hop2 = post(http, f"{decode.url}/v1/completions", body, **{"X-Request-Id": f"pull-{i}"})
            hops.append(asyncio.create_task(hop2))

            async def queued(count: int = i + 1) -> bool:
                state = await get_json(http, f"{decode.url}/kairos/state")
                return len(state["pending_kv_pull_tokens"]) == count

            await eventually(queued, what=f"{i + 1} pulls queued")
        state = await get_json(http, f"{decode.url}/kairos/state")
        assert state["pending_kv_pull_tokens"] == [300, 200]
    assert [status for status, _ in await asyncio.gather(*hops)] == [200, 200]
    assert (await get_json(http, f"{decode.url}/kairos/state"))["pending_kv_pull_tokens"] == []


async def test_the_state_says_how_long_the_kv_pull_in_flight_has_run(
    model_dir: Path, prefill: Node, http: aiohttp.ClientSession
) -> None:
    """While a pull holds the decode node's link, the state says how long it has (model seconds,
    as the node's every time). The node runs slow enough that the transfer lasts a minute of wall
    time, however starved the host; it is cancelled once seen. None while the link is free."""
    hop1 = {"model": MODEL, "prompt": ids(300), "max_tokens": 1, "stream": False}
    hop1["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    status, reply = await post(http, f"{prefill.url}/v1/completions", hop1, **{"X-Request-Id": "slow-pull"})
    assert status == 200, reply
    transfer_s = prefill.node.models.kv_transfer_s(300)
    async with running(model_dir, "d7", Role.DECODE, time_scale=transfer_s / 60.0) as slow:
        assert "running_kv_pull_elapsed_s" not in await get_json(http, f"{slow.url}/kairos/state")
        body = {"model": MODEL, "prompt": ids(300), "max_tokens": 1, "kv_transfer_params": reply["kv_transfer_params"]}
        hop2 = asyncio.create_task(post(http, f"{slow.url}/v1/completions", body, **{"X-Request-Id": "slow-pull"}))

        async def transferring() -> dict[str, Any] | None:
            state = await get_json(http, f"{slow.url}/kairos/state")
            return state if "running_kv_pull_elapsed_s" in state else None

        try:
            state = await eventually(transferring, what="the pull in flight in the state")
            assert state["pending_kv_pull_tokens"] == [300]
            assert state["running_kv_pull_elapsed_s"] >= 0.0  # in model seconds, as the node reports every time
        finally:
            hop2.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await hop2


async def _two_pulls(prefill: Node, decode: Node, http: aiohttp.ClientSession, time_scale: float) -> None:
    n = 20_000
    transfer_wall = decode.node.models.kv_transfer_s(n) / time_scale
    params = []
    for i in range(2):
        hop1 = {
            "model": MODEL,
            "prompt": ids(n),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1, **{"X-Request-Id": f"link-{i}"})
        assert status == 200, reply
        params.append(reply["kv_transfer_params"])
    started = time.monotonic()
    results = await asyncio.gather(
        *(
            post(
                http,
                f"{decode.url}/v1/completions",
                {"model": MODEL, "prompt": ids(n), "max_tokens": 1, "kv_transfer_params": kv},
                **{"X-Request-Id": f"link-{i}"},
            )
            for i, kv in enumerate(params)
        )
    )
    elapsed = time.monotonic() - started
    assert [status for status, _ in results] == [200, 200], results
    assert elapsed >= 2 * transfer_wall * 0.95, (elapsed, transfer_wall)


async def test_two_hop_chat_streams_from_the_decode_node(
    prefill: Node, decode: Node, http: aiohttp.ClientSession
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "stream it"}], "max_completion_tokens": 3}
    hop1 = {**chat, "max_completion_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    status, reply = await post(http, f"{prefill.url}/v1/chat/completions", hop1)
    assert status == 200
    hop2 = {**chat, "stream": True, "kv_transfer_params": reply["kv_transfer_params"]}
    async with http.post(f"{decode.url}/v1/chat/completions", json=hop2) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await resp.text()).split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [p["choices"][0]["delta"].get("content") for p in payloads] == ["", *decode.node.words[:3]]


@pytest.mark.parametrize("api", ["/v1/chat/completions", "/v1/completions"])
async def test_a_streams_first_event_comes_with_its_first_token(
    decode: Node, http: aiohttp.ClientSession, api: str
) -> None:
    """vLLM writes a stream's first event (a chat stream's role chunk too) with the engine's first
    output: a proxy that times the first event times the first token. When the first event
    arrives, the node has counted its first token; a role chunk sent before the prefill would
    arrive while the prompt of 3,000 tokens is still being computed, with no TTFT counted yet."""
    prompt: Any = ids(3000)
    body = {"model": MODEL, "max_tokens": 2, "stream": True}
    body |= {"messages": [{"role": "user", "content": "word " * 3000}]} if "chat" in api else {"prompt": prompt}
    async with http.post(f"{decode.url}{api}", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        ttft_counted = sample(await metrics(http, decode.url), "vllm:time_to_first_token_seconds_count")
        rest = await resp.read()
    assert ttft_counted == 1
    choice = json.loads(first.removeprefix(b"data: "))["choices"][0]
    if "chat" in api:
        assert choice["delta"] == {"role": "assistant", "content": ""}
        assert json.loads(rest.split(b"\n\n")[0].removeprefix(b"data: "))["choices"][0]["delta"]["content"]
    else:
        assert choice["text"] == decode.node.words[0]


async def test_each_streamed_chunk_is_one_token_of_the_models_tokenizer(
    decode: Node, http: aiohttp.ClientSession, tokenizer: PromptTokenizer
) -> None:
    """As vLLM streams one detokenized token per step: a client that re-tokenizes each chunk
    (inference-perf times its ITL and TPOT by that) counts exactly usage.completion_tokens."""
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 12, "stream": True}
    async with http.post(
        f"{decode.url}/v1/completions", json={**body, "stream_options": {"include_usage": True}}
    ) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.text()).split("\n\n") if line]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [p["choices"][0]["text"] for p in payloads if p["choices"]]
    assert len(texts) == payloads[-1]["usage"]["completion_tokens"] == 12
    # vLLM writes a token chunk with exclude_unset: no usage key; the token-id fields are null.
    assert all("usage" not in p for p in payloads[:-1]), payloads[0]
    assert {k: payloads[0]["choices"][0][k] for k in ("prompt_token_ids", "token_ids")} == {
        "prompt_token_ids": None,
        "token_ids": None,
    }
    raw = tokenizer.raw_tokenizer
    assert [len(raw.encode(t, add_special_tokens=False).ids) for t in texts] == [1] * 12
    assert len(raw.encode("".join(texts), add_special_tokens=False).ids) == 12


async def test_unknown_or_malformed_kv_transfer_params_fail_fast(
    prefill: Node, decode: Node, http: aiohttp.ClientSession
) -> None:
    host, port = prefill.host_port.split(":")
    base = {"model": MODEL, "prompt": ids(40), "max_tokens": 4}
    forged = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.node.engine_id,
        "remote_block_ids": [[7, 8, 9]],
        "remote_host": host,
        "remote_port": int(port),
    }
    started = time.monotonic()
    status, body = await post(http, f"{decode.url}/v1/completions", {**base, "kv_transfer_params": forged})
    assert "does not hold" in assert_openai_error(status, body, 400)
    wrong_engine = {**forged, "remote_engine_id": "someone-else"}
    status, body = await post(http, f"{decode.url}/v1/completions", {**base, "kv_transfer_params": wrong_engine})
    assert "engine id" in assert_openai_error(status, body, 400)
    assert time.monotonic() - started < 2.0
    # The reservation made for the failed pulls is given back.
    assert decode.node.engine.engine.kv_reserved == 0
    state = await get_json(http, f"{decode.url}/kairos/state")
    assert state["kv_tokens"] == 0 and state["decode_tokens"] == 0

    for params, fragment in [
        ({**forged, "remote_host": None}, "remote_host"),
        ({**forged, "remote_block_ids": []}, "remote_block_ids"),
        ({**forged, "remote_block_ids": [7, 8, 9]}, "remote_block_ids"),  # not per KV cache group
        ({**forged, "remote_num_tokens": 41}, "the prefill ran another prompt"),
        ({**forged, "remote_num_tokens": -1}, "remote_num_tokens"),
        ({**forged, "remote_num_tokens": "40"}, "remote_num_tokens"),
        ("not an object", "kv_transfer_params"),
    ]:
        status, body = await post(http, f"{decode.url}/v1/completions", {**base, "kv_transfer_params": params})
        assert fragment in assert_openai_error(status, body, 400)
    # Each role serves only its own hop.
    status, body = await post(http, f"{prefill.url}/v1/completions", {**base, "kv_transfer_params": forged})
    assert "decode node" in assert_openai_error(status, body, 400)
    hop1 = {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, body = await post(http, f"{decode.url}/v1/completions", hop1)
    assert "prefill node" in assert_openai_error(status, body, 400)
    status, body = await post(http, f"{prefill.url}/v1/completions", {**hop1, "max_tokens": 5})
    assert "max_tokens 1" in assert_openai_error(status, body, 400)
    # Nobody listening where the parameters point: 502, not a hang.
    dead = {**forged, "remote_port": 1}
    status, body = await post(http, f"{decode.url}/v1/completions", {**base, "kv_transfer_params": dead})
    assert_openai_error(status, body, 502)


async def test_unpulled_kv_is_released_after_the_hold_timeout(
    model_dir: Path, decode: Node, http: aiohttp.ClientSession
) -> None:
    # Wall seconds, as vLLM's timeout, whatever the time scale (20x here).
    async with running(model_dir, "p1", Role.PREFILL, kv_hold_timeout_s=0.1) as p:
        body = {"model": MODEL, "prompt": ids(64), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{p.url}/v1/completions", body)
        assert status == 200
        assert (await get_json(http, f"{p.url}/kairos/state"))["kv_tokens"] == 65

        async def released() -> bool:
            return (await get_json(http, f"{p.url}/kairos/state"))["kv_tokens"] == 0

        await eventually(released, what="the unpulled KV released")
        hop2 = {"model": MODEL, "prompt": ids(64), "max_tokens": 3, "kv_transfer_params": reply["kv_transfer_params"]}
        status, err = await post(http, f"{decode.url}/v1/completions", hop2)
        assert "expired" in assert_openai_error(status, err, 400)


# ---------------------------------------------------------------------------------------------
# Deflected prefills
# ---------------------------------------------------------------------------------------------
async def test_deflected_request_runs_exactly_its_chunk_schedule(decode: Node, http: aiohttp.ClientSession) -> None:
    since = (await get_json(http, f"{decode.url}/kairos/steps"))["next_index"]
    body = {
        "model": MODEL,
        "prompt": ids(700),
        "max_tokens": 3,
        "vllm_xargs": {"kairos_chunk_schedule": [300, 200], "kairos_step_budget_ms": 5000.0},
    }
    status, done = await post(http, f"{decode.url}/v1/completions", body, **{"X-Request-Id": "deflected-1"})
    assert status == 200 and done["usage"]["prompt_tokens"] == 700 and done["usage"]["completion_tokens"] == 3
    steps = (await get_json(http, f"{decode.url}/kairos/steps?since={since}"))["steps"]
    chunks = [(c["tokens"], c["cached"]) for s in steps for c in s["chunks"] if c["request_id"] == "deflected-1"]
    assert chunks == [(300, 0), (200, 300), (200, 500)]
    assert [s["index"] for s in steps] == list(range(since, since + 5))  # 3 chunk steps + 2 decode steps
    assert steps[3]["decode_tokens"] == 1 and steps[3]["chunks"] == []


@pytest.mark.parametrize(
    ("xargs", "fragment"),
    [
        ({"kairos_chunk_schedule": []}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [300, 0]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": "300,200"}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [300.5]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [None]}, "a string, a number or an array of them"),
        ({"kairos_chunk_schedule": [256], "kairos_step_budget_ms": 0}, "positive number of milliseconds"),
        ({"kairos_chunk_schedule": [256], "kairos_step_budget_ms": "70"}, "positive number of milliseconds"),
        ({"kairos_step_budget_ms": 70.0}, "needs vllm_xargs.kairos_chunk_schedule"),
        ({"kairos_tpot_slo_ms": 0}, "positive number of milliseconds"),
        ({"kairos_tpot_slo_ms": "60"}, "positive number of milliseconds"),
        ("schedule", "vllm_xargs must be an object"),
    ],
)
async def test_malformed_chunk_schedule_is_a_400(
    decode: Node, http: aiohttp.ClientSession, xargs: Any, fragment: str
) -> None:
    # Exactly vLLM's answers, for the plugin parser's cases: tests/component/test_schedule_parity.py.
    body = {"model": MODEL, "prompt": ids(100), "max_tokens": 2, "vllm_xargs": xargs}
    status, err = await post(http, f"{decode.url}/v1/completions", body)
    assert fragment in assert_openai_error(status, err, 400)
    assert (await get_json(http, f"{decode.url}/kairos/steps"))["steps"] == []  # nothing ran


async def test_a_chunk_is_held_to_the_tpot_of_the_decodes_beside_it(decode: Node, http: aiohttp.ClientSession) -> None:
    """vllm_xargs kairos_tpot_slo_ms, as the sidecar sends it: a batch request's chunk carrying a
    150 ms budget gets whole steps beside a batch decode, and steps held to 60/150 of it beside an
    interactive one; the state reports the tightest TPOT in flight, and none once idle."""
    state_url = f"{decode.url}/kairos/state"
    assert "tpot_slo_ms" not in await get_json(http, state_url)

    async def largest_chunk_beside(decode_tpot_ms: float, rid: str) -> int:
        long = {"model": MODEL, "prompt": ids(32), "max_tokens": 5000, "stream": True}
        long["vllm_xargs"] = {"kairos_tpot_slo_ms": decode_tpot_ms}
        resp = await http.post(f"{decode.url}/v1/completions", json=long)
        try:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # its first token: it decodes
            assert (await get_json(http, state_url))["tpot_slo_ms"] == decode_tpot_ms
            since = (await get_json(http, f"{decode.url}/kairos/steps"))["next_index"]
            xargs = {"kairos_chunk_schedule": [2000], "kairos_step_budget_ms": 150.0, "kairos_tpot_slo_ms": 150}
            prompt = [int(decode_tpot_ms), *ids(1999)]  # its own first token: no prefix hit
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "vllm_xargs": xargs}
            status, _ = await post(http, f"{decode.url}/v1/completions", body, **{"X-Request-Id": rid})
            assert status == 200
            steps = (await get_json(http, f"{decode.url}/kairos/steps?since={since}"))["steps"]
        finally:
            resp.close()  # the long decode stops
        chunks = [c["tokens"] for s in steps for c in s["chunks"] if c["request_id"] == rid]
        assert sum(chunks) == 2000
        assert all(s["decode_tokens"] == 1 for s in steps if any(c["request_id"] == rid for c in s["chunks"]))

        async def idle() -> bool:
            return (await get_json(http, state_url))["decode_tokens"] == 0

        await eventually(idle, what="the long decode stopped")
        return max(chunks)

    loose = await largest_chunk_beside(150, "beside-batch")
    tight = await largest_chunk_beside(60, "beside-interactive")
    assert tight < loose
    assert "tpot_slo_ms" not in await get_json(http, state_url)


# ---------------------------------------------------------------------------------------------
# State and metrics
# ---------------------------------------------------------------------------------------------
async def test_state_and_metrics_follow_a_concurrent_load(model_dir: Path, http: aiohttp.ClientSession) -> None:
    # Two sequences resident at most: of five concurrent requests, three wait. Four times slower
    # than the other tests, so the first two decode for 1.2 s of wall time: a starved host must
    # still be able to scrape the metrics and the state while that state lasts.
    async with running(model_dir, "d1", Role.DECODE, max_running=2, max_step_tokens=1024, time_scale=SCALE / 4) as d:
        body = {"model": MODEL, "prompt": ids(200), "max_tokens": 120}
        tasks = [asyncio.create_task(post(http, f"{d.url}/v1/completions", body)) for _ in range(5)]

        async def two_running_three_waiting() -> bool:
            m = await metrics(http, d.url)
            return (
                sample(m, "vllm:num_requests_running") == 2
                and sample(m, "vllm:num_requests_waiting") == 3
                and sample(m, "vllm:kv_cache_usage_perc") > 0
            )

        async def state_shows_it() -> bool:
            s = await get_json(http, f"{d.url}/kairos/state")
            return s["decode_tokens"] == 2 and s["queued_prefill_tokens"] == [200, 200, 200]

        await eventually(two_running_three_waiting, what="2 running, 3 waiting in the metrics")
        await eventually(state_shows_it, what="2 decoding, 3 queued in the state")
        state = await get_json(http, f"{d.url}/kairos/state")
        assert set(state) == {
            "decode_tokens",
            "kv_tokens",
            "kv_capacity_tokens",
            "queued_prefill_tokens",
            "scheduled_prefill_tokens",
            "max_step_tokens",
            "model",
            "step_calibration",
            "pending_kv_pull_tokens",  # a decode node's KV pulls: none here
            "scheduled_prefill_computed_tokens",  # one per deflected prefill: none here
            "tpot_slo_ms",  # the tightest TPOT in flight: requests without one hold the cluster's
            "queued_prefill_computed_tokens",  # one per queued prefill
            "running_step_elapsed_s",  # two decoding: a step is always in flight
        }
        # In model seconds, as every time the node reports (on a starved host the loop can trail
        # the clock, so no upper bound here; tests/unit/test_step_phase.py checks the engine's).
        assert isinstance(state["running_step_elapsed_s"], float) and state["running_step_elapsed_s"] >= 0
        assert state["tpot_slo_ms"] == pytest.approx(defaults.TBT_SLO_S * 1e3)
        # The node calibrates on its steps as its readers saw them (wall time, late wakes on a
        # busy host included): never under the prior (1.0, the packaged profile has no measured
        # error) while it has measured few steps.
        assert 1.0 <= state["step_calibration"] <= 4.0
        assert state["pending_kv_pull_tokens"] == []
        assert state["kv_tokens"] > 400 and state["max_step_tokens"] == 1024 and state["model"] == MODEL
        assert state["scheduled_prefill_tokens"] == []
        assert state["scheduled_prefill_computed_tokens"] == []
        assert state["queued_prefill_computed_tokens"] == [0, 0, 0]  # three waiting, none begun

        results = await asyncio.gather(*tasks)
        assert all(status == 200 and body["usage"]["completion_tokens"] == 120 for status, body in results)
        m = await metrics(http, d.url)
        assert sample(m, "vllm:num_requests_running") == 0 and sample(m, "vllm:num_requests_waiting") == 0
        assert sample(m, "vllm:kv_cache_usage_perc") == 0
        assert sample(m, "vllm:prompt_tokens_total") == 1000
        assert sample(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 1000
        assert sample(m, "vllm:generation_tokens_total") == 600
        assert sample(m, "vllm:time_to_first_token_seconds_count") == 5
        assert sample(m, "vllm:inter_token_latency_seconds_count") == 5 * 119
        state = await get_json(http, f"{d.url}/kairos/state")
        assert (state["decode_tokens"], state["kv_tokens"], state["queued_prefill_tokens"]) == (0, 0, [])
        assert "tpot_slo_ms" not in state  # none in flight
        assert "running_step_elapsed_s" not in state  # idle: no step in flight


async def test_client_disconnect_mid_stream_stops_the_sequence(decode: Node, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": ids(50), "max_tokens": 5000, "stream": True}  # ~12 s of wall time
    resp = await http.post(f"{decode.url}/v1/completions", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    resp.close()  # drop the connection

    async def idle() -> bool:
        s = await get_json(http, f"{decode.url}/kairos/state")
        return s["decode_tokens"] == 0 and s["kv_tokens"] == 0

    await eventually(idle, what="the aborted sequence gone")
    # An abort, not the end of the ~12 s stream: far fewer than its 5000 tokens were generated.
    assert sample(await metrics(http, decode.url), "vllm:generation_tokens_total") < 5000
    status, ok = await post(
        http, f"{decode.url}/v1/completions", {"model": MODEL, "prompt": "still fine", "max_tokens": 2}
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
async def test_bad_input_gets_openai_style_4xx(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with running(model_dir, "d2", Role.DECODE, max_model_len=512, max_body_bytes=4096) as d:
        url = f"{d.url}/v1/completions"
        cases: list[tuple[Any, int, str]] = [
            (b"{not json", 400, "not valid JSON"),
            (b"[1, 2]", 400, "JSON object"),
            ({"model": MODEL, "max_tokens": 3}, 400, "prompt is required"),
            ({"model": MODEL, "prompt": "", "max_tokens": 3}, 400, "prompt is empty"),
            ({"model": MODEL, "prompt": ids(500), "max_tokens": 20}, 400, "maximum context length is 512"),
            ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
            ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
            ({"model": MODEL, "prompt": "x" * 5000}, 413, "limit"),
        ]
        for body, status_expected, fragment in cases:
            status, err = await post(http, url, body)
            assert fragment in assert_openai_error(status, err, status_expected), (body, err)
        status, err = await post(http, f"{d.url}/v1/chat/completions", {"model": MODEL, "messages": []})
        assert "messages is empty" in assert_openai_error(status, err, 400)
        status, err = await post(http, f"{d.url}/v1/embeddings", {"model": MODEL, "input": "x"})
        assert_openai_error(status, err, 404)
        async with http.get(url) as resp:
            assert_openai_error(resp.status, await resp.json(), 405)
        async with http.get(f"{d.url}/kairos/steps?since=-3") as resp:
            assert_openai_error(resp.status, await resp.json(), 400)
        async with http.get(f"{d.url}/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        assert (await get_json(http, f"{d.url}/kairos/steps"))["steps"] == []  # nothing reached the engine


async def test_tokenize_detokenize_and_version_answer_as_vllm(
    decode: Node, http: aiohttp.ClientSession, tokenizer: PromptTokenizer
) -> None:
    """vLLM 0.32's serve/tokenize and /version: a prompt gets its BOS unless add_special_tokens
    is false, messages the chat template without added specials; token_strs is null unless asked."""
    text = "Hello, Kairos"
    async with http.post(f"{decode.url}/tokenize", json={"model": MODEL, "prompt": text}) as resp:
        assert resp.status == 200
        out = await resp.json()
    ids_ = tokenizer.encode(text, add_special_tokens=True)
    assert out == {
        "count": len(ids_),
        "max_model_len": decode.node.config.max_model_len,
        "tokens": ids_,
        "token_strs": None,
    }
    assert ids_[0] == tokenizer.bos_token_id
    async with http.post(
        f"{decode.url}/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    ) as resp:
        plain = await resp.json()
    assert plain["tokens"] == ids_[1:]
    assert plain["token_strs"] == [tokenizer.raw_tokenizer.id_to_token(t) for t in ids_[1:]]
    messages = [{"role": "user", "content": text}]
    async with http.post(f"{decode.url}/tokenize", json={"messages": messages}) as resp:
        chat = await resp.json()
    assert chat["count"] == tokenizer.count_chat_prompt(messages)  # what a chat request is counted as
    async with http.post(f"{decode.url}/detokenize", json={"tokens": ids_[1:]}) as resp:
        assert await resp.json() == {"prompt": text}
    async with http.get(f"{decode.url}/version") as resp:
        assert await resp.json() == {"version": "0.32.0"}
    for path, body, status_expected in (
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404),
        ("/tokenize", {"prompt": 3}, 400),
        ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
    ):
        status, err = await post(http, f"{decode.url}{path}", body)
        assert_openai_error(status, err, status_expected)


def test_config_validation(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="kv_capacity_tokens=1000 must be >= max_model_len=4096"):
        EmulatedNodeConfig("d0", Role.DECODE, str(model_dir), max_model_len=4096, kv_capacity_tokens=1000)
    with pytest.raises(ConfigError, match="time_scale"):
        load_config(
            EmulatedNodeConfig, overrides={"node_id": "d0", "role": "decode", "model_dir": "m", "time_scale": 0}
        )
    with pytest.raises(ConfigError, match="role"):
        load_config(EmulatedNodeConfig, overrides={"node_id": "d0", "role": "both", "model_dir": "m"})
    cfg = load_config(EmulatedNodeConfig, overrides={"node_id": "p0", "role": "prefill", "model_dir": "/models/x"})
    assert cfg.role is Role.PREFILL and cfg.model == "/models/x"  # vLLM serves the path when no name is given


# ---------------------------------------------------------------------------------------------
# The wall-time driver on its own
# ---------------------------------------------------------------------------------------------
async def test_realtime_engine_streams_tokens_and_queues_transfers_for_kv_room() -> None:
    """Asserts model time, step indices and counts, never wall time: on a starved host the step
    loop falls behind and resynchronises (model time jumps ahead), and that must not fail it."""
    engine = Engine(
        EngineConfig("r0", Role.DECODE, 256, kv_capacity_tokens=1000), lambda role, plan: 0.05, track_tokens=True
    )
    rt = RealtimeEngine(engine, time_scale=50.0)  # 1 ms of wall time per step
    rt.start()
    try:
        await rt.reserve_kv(600)
        # 600 + 600 > 1000: the second transfer waits for room, a cancelled third gives up its place.
        # Both queue before the first sequence runs, so nothing can free room while this is checked.
        second_room = asyncio.create_task(rt.reserve_kv(600))
        third_room = asyncio.create_task(rt.reserve_kv(100))  # would fit, but waits behind the second
        await eventually(lambda: rt.pending_transfers == 2, what="two transfers waiting for room")
        assert not second_room.done() and not third_room.done()
        third_room.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third_room
        assert rt.pending_transfers == 1 and not second_room.done()

        first = rt.accept_transferred(Seq("first", 600, 4), 600)
        events = [e async for e in first]
        assert [(e.index, e.step) for e in events] == [(1, 0), (2, 1), (3, 2), (4, 3)]  # one token a step
        assert [e.last for e in events] == [False, False, False, True]
        # Each token lands at the model-time end of the step that made it, and steps last their
        # modelled 0.05 s; a resync may only open a gap between steps, never shorten one.
        steps = rt.steps_since(0)[:4]
        assert [s["duration"] for s in steps] == [0.05] * 4
        assert [e.at for e in events] == pytest.approx([s["start"] + s["duration"] for s in steps])
        assert all(b.at - a.at >= 0.05 - 1e-9 for a, b in itertools.pairwise(events))
        if rt.resyncs == 0:  # on time: the steps chain back to back in model time
            assert [e.at for e in events] == pytest.approx([events[0].at + 0.05 * i for i in range(4)])
        await asyncio.wait_for(second_room, 30.0)  # granted as the first sequence freed its KV
        assert engine.kv_reserved == 600 and rt.pending_transfers == 0  # the cancelled third took none
        rt.unreserve_kv(600)
        plain = rt.submit(Seq("plain", 200, 2))
        assert [e.step for e in [e async for e in plain]] == [4, 5] == [engine.step_index - 2, engine.step_index - 1]
        assert (engine.kv_used, engine.kv_reserved) == (0, 0)
        assert [s["chunks"] for s in rt.steps_since(4)] == [[{"request_id": "plain", "tokens": 200, "cached": 0}], []]
    finally:
        await rt.stop()
    with pytest.raises(EngineStoppedError):
        rt.submit(Seq("late", 10, 1))


# ---------------------------------------------------------------------------------------------
# Time scale and the CLI
# ---------------------------------------------------------------------------------------------
async def test_time_scale_divides_wall_time(model_dir: Path, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": ids(1000), "max_tokens": 60}
    walls, model, resyncs = {}, {}, {}
    for scale in (10.0, 40.0):
        async with running(model_dir, f"t{int(scale)}", Role.DECODE, time_scale=scale) as d:
            started = time.perf_counter()
            status, _ = await post(http, f"{d.url}/v1/completions", body)
            walls[scale] = time.perf_counter() - started
            assert status == 200
            steps = (await get_json(http, f"{d.url}/kairos/steps"))["steps"]
            model[scale] = sum(s["duration"] for s in steps)
            # Steps chain back to back in model time, whatever the timer overshoot on the wall,
            # unless the loop fell over MAX_LAG_S behind (a starved CI host) and dropped that time.
            assert d.node.rt is not None
            resyncs[scale] = d.node.rt.resyncs
            if d.node.rt.resyncs == 0:
                span = steps[-1]["start"] + steps[-1]["duration"] - steps[0]["start"]
                assert span == pytest.approx(model[scale])
    # Same model time either way (60 steps of ~46 ms: ~2.8 s). A step never ends early, so the
    # wall time is at least model time over the scale. The upper bound is loose (a shared, busy
    # machine) but still far below the 2.8 s an unscaled engine would take; it holds only while
    # the step loop kept up: a starved loop resyncs (counted) and then drops wall time on purpose.
    assert model[10.0] == pytest.approx(model[40.0]) and model[10.0] > 2.0
    for scale, wall in walls.items():
        assert model[scale] / scale <= wall, (scale, wall, model[scale])
        if resyncs[scale] == 0:
            assert wall <= model[scale] / scale * 3 + 0.8, (scale, wall, model[scale])


async def test_cli_listens_and_stops_on_sigterm(model_dir: Path, http: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kairos.sim.emulated_vllm",
        "--node-id",
        "c0",
        "--role",
        "decode",
        "--port",
        "0",
        "--model-dir",
        str(model_dir),
        "--model",
        MODEL,
        "--time-scale",
        "50",
        "--log-level",
        "WARNING",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        assert line.startswith("listening on 127.0.0.1:"), line
        url = f"http://{line.removeprefix('listening on ')}"
        status, body = await post(http, f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_steps_over_a_deflected_chunks_budget_while_decodes_run_are_counted() -> None:
    """The emulated node's own guard keeps its chunks within budget (its timer is its model), so
    the count is driven here by an engine with no guard and a step time over the budget."""
    engine = Engine(
        EngineConfig("r1", Role.DECODE, 256, kv_capacity_tokens=10_000), lambda role, plan: 0.05, track_tokens=True
    )
    rt = RealtimeEngine(engine, time_scale=50.0)
    rt.start()
    try:
        # Alone on the node (no decode runs): its chunks carry a budget but protect nobody.
        alone = rt.submit(Seq("alone", 300, 1, schedule=(100,), step_budget_s=0.01))
        [e async for e in alone]
        assert rt.step_budget_overruns == 0
        await rt.reserve_kv(10)
        decoding = rt.accept_transferred(Seq("decoding", 10, 60), 10)  # outlasts the six chunk steps
        # Three chunks of 100 while "decoding" runs: each 0.05 s step is over the 0.01 s budget ...
        over = rt.submit(Seq("over", 300, 1, schedule=(100,), step_budget_s=0.01))
        [e async for e in over]
        # ... and three within a 1 s budget are not.
        within = rt.submit(Seq("within", 300, 1, schedule=(100,), step_budget_s=1.0))
        [e async for e in within]
        assert len([e async for e in decoding]) == 60
        assert rt.step_budget_overruns == 3
    finally:
        await rt.stop()


async def test_metrics_export_the_step_budget_overruns(decode: Node, http: aiohttp.ClientSession) -> None:
    name = f"{STEP_BUDGET_OVERRUNS_METRIC}_total"
    assert (await metrics(http, decode.url))[name] == 0  # exported from the start
    assert decode.node.rt is not None
    decode.node.rt.step_budget_overruns = 3
    assert (await metrics(http, decode.url))[name] == 3
    decode.node.rt.step_budget_overruns = 5
    assert (await metrics(http, decode.url))[name] == 5  # scraped twice, counted once
