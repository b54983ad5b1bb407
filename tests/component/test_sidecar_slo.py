"""The sidecar judges each completion against its own SLOs, live: real HTTP on 127.0.0.1 through
the sidecar to a fake vLLM that streams with the gaps a test asks for, and the values of
kairos_sidecar_slo_requests_total{class,outcome} and kairos_sidecar_slo_goodput_tokens_total{class}
after each kind of request (met, missed on TTFT, missed on TPOT, broken off, not streamed, left).

The gaps are far from the SLOs they are judged by (10 ms against 1 s, 300 ms against 100 ms), so
a slow host only widens the margin; the 5% boundary is the unit tests' (test_slo_judging.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kairos.common import contracts as c
from kairos.common.config import load_config
from kairos.common.errors import ConfigError
from kairos.nodeagent.sidecar import SLO_OUTCOMES, SidecarConfig, app_runner
from kairos.sim.emulated_vllm import VLLM_MAX_HEAD_BYTES
from tests.waiting import eventually

SLO_REQUESTS = "kairos_sidecar_slo_requests_total"
GOODPUT = "kairos_sidecar_slo_goodput_tokens_total"


def _event(choice: dict[str, Any], chat: bool, usage: dict[str, int] | None = None) -> bytes:
    obj = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "model": "tiny",
        "choices": [choice] if choice else [],
        "usage": usage,
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class PacedVLLM:
    """A decode vLLM stand-in whose stream follows the request's ``script``: seconds before the
    first token, the gap before each later one, and whether to break off the connection after
    some tokens. Its events are vLLM's shape (a chat stream's role event with the first token,
    a usage event when asked, then [DONE])."""

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        script = body["script"]
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            await asyncio.sleep(script["first_s"])
            return web.json_response({"id": "cmpl-1", "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        gaps = script["gaps_s"]
        try:
            for i, gap in enumerate([script["first_s"], *gaps]):
                await asyncio.sleep(gap)
                if i == script.get("break_after"):
                    assert request.transport is not None
                    request.transport.close()
                    return out
                finish = "length" if i == len(gaps) else None
                if chat:
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    token = {"index": 0, "delta": {"content": f"t{i}"}, "logprobs": None, "finish_reason": finish}
                    await out.write((_event(role, chat) if i == 0 else b"") + _event(token, chat))
                else:
                    token = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": finish}
                    await out.write(_event(token, chat))
            if body.get("stream_options", {}).get("include_usage"):
                n = len(gaps) + 1
                await out.write(_event({}, chat, {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:  # the sidecar left: the client did
            pass
        return out


@dataclass
class Rig:
    url: str
    http: aiohttp.ClientSession

    async def metrics(self) -> dict[tuple[str, ...], float]:
        async with self.http.get(f"{self.url}{c.SIDECAR_METRICS_PATH}") as resp:
            text = await resp.text()
        out: dict[tuple[str, ...], float] = {}
        for line in text.splitlines():
            for name in (SLO_REQUESTS, GOODPUT):
                if line.startswith(name + "{"):
                    labels = dict(
                        part.split("=", 1) for part in line[len(name) + 1 : line.index("}")].replace('"', "").split(",")
                    )
                    out[(name, labels["class"], labels.get("outcome", ""))] = float(line.split()[-1])
        return out

    async def judged(self, total: int) -> dict[tuple[str, ...], float]:
        """The SLO series once ``total`` requests are counted (a request is counted as its
        handler ends, which may be just after its client read the last byte)."""

        async def counted() -> dict[tuple[str, ...], float] | None:
            values = await self.metrics()
            return values if sum(v for k, v in values.items() if k[0] == SLO_REQUESTS) >= total else None

        values = await eventually(counted, what=f"{total} requests judged")
        assert values is not None
        return values


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fake = web.Application()
    fake.router.add_post("/v1/completions", PacedVLLM().completion)
    fake.router.add_post("/v1/chat/completions", PacedVLLM().completion)
    fake_runner = web.AppRunner(
        fake, shutdown_timeout=0.1, handler_cancellation=True, max_line_size=VLLM_MAX_HEAD_BYTES
    )
    await fake_runner.setup()
    await web.TCPSite(fake_runner, "127.0.0.1", 0).start()
    host, port = fake_runner.addresses[0][:2]
    sidecar = app_runner(SidecarConfig(port=0, local_vllm=f"{host}:{port}", hop2_timeout_s=10.0), shutdown_timeout=0.1)
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    s_host, s_port = sidecar.addresses[0][:2]
    async with aiohttp.ClientSession() as http:
        yield Rig(f"http://{s_host}:{s_port}", http)
    await sidecar.cleanup()
    await fake_runner.cleanup()


def _routed(ttft_ms: str, tpot_ms: str, slo_class: str, **own: str) -> dict[str, str]:
    """The headers the dispatcher sets on a deflection decided by these SLOs, plus the client's own."""
    return {
        c.H_ROUTE: "deflect",
        c.H_CHUNK_SCHEDULE: "16",
        c.H_DECIDED_TTFT_SLO_MS: ttft_ms,
        c.H_DECIDED_TPOT_SLO_MS: tpot_ms,
        c.H_SLO_CLASS: slo_class,
        **own,
    }


BATCH = _routed("20000", "1000", "batch")  # loose: 10 ms gaps meet it on any host
INTERACTIVE = _routed("100", "100", "interactive")


async def _send(rig: Rig, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    async with rig.http.post(f"{rig.url}{path}", json=body, headers=headers) as resp:
        assert resp.status == 200
        return await resp.read()


def _completion(first_s: float, gaps_s: list[float], **script: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "hi",
        "stream": True,
        "max_tokens": len(gaps_s) + 1,
        "script": {"first_s": first_s, "gaps_s": gaps_s, **script},
    }


async def test_every_class_and_outcome_is_there_before_any_request(rig: Rig) -> None:
    values = await rig.metrics()
    classes = ("interactive", "standard", "batch")
    assert values == {
        **{(SLO_REQUESTS, k, o): 0.0 for k in classes for o in SLO_OUTCOMES},
        **{(GOODPUT, k, ""): 0.0 for k in classes},
    }


async def test_met_and_missed_requests_and_the_goodput_of_those_that_met(rig: Rig) -> None:
    # Met: 10 token events 10 ms apart (no usage event: the events are the tokens) ...
    await _send(rig, "/v1/completions", _completion(0.0, [0.01] * 9), BATCH)
    # ... and a chat stream asking for usage: 6 tokens (its role event is none).
    chat = {**_completion(0.0, [0.01] * 5), "messages": [{"role": "user", "content": "hi"}]}
    chat["stream_options"] = {"include_usage": True}
    del chat["prompt"]
    stream = await _send(rig, "/v1/chat/completions", chat, BATCH)
    assert b'"role":"assistant"' in stream and b'"completion_tokens":6' in stream
    # Missed on TPOT: every one of 4 gaps 300 ms, over its 100 ms.
    await _send(rig, "/v1/completions", _completion(0.0, [0.3] * 4), INTERACTIVE)
    # Missed on TTFT: its first token 300 ms after it arrived, over its 100 ms.
    await _send(rig, "/v1/completions", _completion(0.3, [0.01] * 3), INTERACTIVE)
    values = await rig.judged(4)
    assert values[SLO_REQUESTS, "batch", "met"] == 2
    assert values[GOODPUT, "batch", ""] == 10 + 6
    assert values[SLO_REQUESTS, "interactive", "missed"] == 2
    assert values[GOODPUT, "interactive", ""] == 0
    assert sum(v for k, v in values.items() if k[0] == SLO_REQUESTS) == 4


async def test_a_request_is_judged_by_its_own_slos_over_the_decided_ones(rig: Rig) -> None:
    # An SLO-blind policy decided it by the cluster's SLOs (loose here); its own TPOT is 100 ms.
    own = _routed("20000", "1000", "interactive", **{c.H_SLO_TTFT_MS: "20000", c.H_SLO_TPOT_MS: "100"})
    await _send(rig, "/v1/completions", _completion(0.0, [0.3] * 4), own)
    values = await rig.judged(1)
    assert values[SLO_REQUESTS, "interactive", "missed"] == 1


async def test_a_forged_class_is_counted_in_the_class_its_slos_fall_in(rig: Rig) -> None:
    forged = {c.H_SLO_CLASS: "platinum", c.H_SLO_TTFT_MS: "20000", c.H_SLO_TPOT_MS: "150"}
    await _send(rig, "/v1/completions", _completion(0.0, [0.01] * 4), forged)  # straight to the sidecar
    values = await rig.judged(1)
    assert values[SLO_REQUESTS, "batch", "met"] == 1 and values[GOODPUT, "batch", ""] == 5
    assert not [k for k in values if k[1] == "platinum"]


async def test_what_cannot_be_judged_is_unobserved_and_a_broken_stream_missed(rig: Rig) -> None:
    # Not streamed: one JSON body after the last token, no TTFT to judge.
    await _send(rig, "/v1/completions", {**_completion(0.0, []), "stream": False}, BATCH)
    # Broken off by the node after its first two tokens: a failed request misses.
    broken = await _send(rig, "/v1/completions", _completion(0.0, [0.01] * 5, break_after=2), BATCH)
    assert b'"error"' in broken
    # The client leaves after the first token.
    async with rig.http.post(f"{rig.url}/v1/completions", json=_completion(0.0, [0.2] * 20), headers=BATCH) as resp:
        await resp.content.readuntil(b"\n\n")
        resp.close()
    values = await rig.judged(3)
    assert values[SLO_REQUESTS, "batch", "unobserved"] == 2
    assert values[SLO_REQUESTS, "batch", "missed"] == 1
    assert values[SLO_REQUESTS, "batch", "met"] == 0 and values[GOODPUT, "batch", ""] == 0


def test_the_configured_classes_are_the_labels() -> None:
    config = load_config(SidecarConfig, overrides={"slo_classes": "gold=500/40, bronze=30000/200"})
    assert [k.name for k in config.slo_classes] == ["gold", "bronze"]
    with pytest.raises(ConfigError, match="name=TTFT_MS/TPOT_MS"):
        load_config(SidecarConfig, overrides={"slo_classes": "gold"})
