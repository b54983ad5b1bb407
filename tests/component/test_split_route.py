"""The split route on real sockets: a sidecar over an emulated 1P1D pair (and the emulated nodes
alone). The prefill node computes the prompt's first k tokens, the decode node pulls their KV and
prefills the rest under the dispatcher's schedule; the client's answer is a keep's. A chat request
splits by the local vLLM's /tokenize; a dead prefill node fails over to a local prefill; a prompt
the node counts otherwise than the dispatcher, or a split the decode node's vLLM refuses (it does not
load Kairos's split connector), is served as a keep. While its KV is on its way, the decode node
reports a split as the vLLM plugin does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

import kairos.nodeagent.sidecar.app as sidecar_app
from kairos.api.openai_request import RequestLimits, parse_request
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.contracts import Role
from kairos.common.contracts.split_refusal import SPLIT_CONNECTOR, describe_connector, split_refusal
from kairos.launcher.processes import free_port
from kairos.launcher.tinymodel import build_tiny_model
from kairos.nodeagent.sidecar import SidecarConfig, app_runner
from kairos.nodeagent.sidecar.split import is_split_refused
from kairos.nodeagent.vllm_plugin.engine_state import PendingPrefill, build_state
from tests.component.test_emulated_vllm import MODEL, Node, get_json, metrics, post, running, sample
from tests.redis_server import RedisServer
from tests.waiting import eventually

BS = 16  # the emulated nodes' KV block (vLLM's default)
BUDGET_MS = "5000.000"  # generous: the chunks run whole beside the tiny batches here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel-split")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@dataclass
class Pair:
    """A 1P1D pair of emulated nodes and the decode node's sidecar."""

    prefill: Node
    decode: Node
    sidecar: str  # base URL

    def split(self, k: int, prompt_tokens: int, schedule: str, **extra: str) -> dict[str, str]:
        return {
            c.H_ROUTE: "split",
            c.H_PREFILL_HOST: self.prefill.host_port,
            c.H_SPLIT_TOKENS: str(k),
            c.H_CHUNK_SCHEDULE: schedule,
            c.H_STEP_BUDGET_MS: BUDGET_MS,
            c.H_PROMPT_TOKENS: str(prompt_tokens),
            c.H_DECODE_NODE: "d0",
            **extra,
        }

    def keep(self, prompt_tokens: int, **extra: str) -> dict[str, str]:
        return {
            c.H_ROUTE: "keep",
            c.H_PREFILL_HOST: self.prefill.host_port,
            c.H_STEP_BUDGET_MS: BUDGET_MS,
            c.H_PROMPT_TOKENS: str(prompt_tokens),
            c.H_DECODE_NODE: "d0",
            **extra,
        }


@asynccontextmanager
async def pair(
    model_dir: Path, also_allowed: tuple[str, ...] = (), decode_node: dict[str, Any] | None = None, **sidecar: Any
) -> AsyncIterator[Pair]:
    async with AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(running(model_dir, "p0", Role.PREFILL))
        decode = await stack.enter_async_context(running(model_dir, "d0", Role.DECODE, **(decode_node or {})))
        settings: dict[str, Any] = {
            "port": 0,
            "local_vllm": decode.host_port,
            "allowed_prefill_hosts": (prefill.host_port, *also_allowed),
            "hop1_timeout_s": 20.0,
            "hop2_timeout_s": 20.0,
            **sidecar,
        }
        runner = app_runner(SidecarConfig(**settings), shutdown_timeout=0.1)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield Pair(prefill, decode, f"http://127.0.0.1:{runner.addresses[0][1]}")


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 3000 for i in range(n)]


async def complete(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], path: str = "/v1/completions"
) -> tuple[str, dict[str, Any]]:
    """The answer's text and usage, streamed or not (a stream's text put together)."""
    async with http.post(f"{url}{path}", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            reply = await resp.json()
            choice = reply["choices"][0]
            return choice.get("text", choice.get("message", {}).get("content")), reply["usage"]
        raw = await resp.read()
    events = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    text = "".join(
        ch.get("text", ch.get("delta", {}).get("content") or "") for e in events for ch in e.get("choices", [])
    )
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    return text, usage


async def chunks_of(http: aiohttp.ClientSession, node: Node, rid: str) -> list[tuple[int, int]]:
    """(tokens, cached) of each prefill chunk the node ran for request ``rid``, in step order."""
    steps = (await get_json(http, f"{node.url}/kairos/steps"))["steps"]
    return [(ch["tokens"], ch["cached"]) for s in steps for ch in s["chunks"] if ch["request_id"] == rid]


async def by_source(http: aiohttp.ClientSession, node: Node) -> dict[str, float]:
    m = await metrics(http, node.url)
    name = "vllm:prompt_tokens_by_source_total"
    return {s: sample(m, name, source=s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


async def sidecar_metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with http.get(f"{url}{c.SIDECAR_METRICS_PATH}") as resp:
        text = await resp.text()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.split()[-1])


async def released(http: aiohttp.ClientSession, node: Node) -> bool:
    return (await get_json(http, f"{node.url}/kairos/state"))["kv_tokens"] == 0


# ---------------------------------------------------------------------------------------------
# Through the sidecar
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_a_split_answers_as_a_keep_and_each_node_computes_its_part(
    model_dir: Path, http: aiohttp.ClientSession, stream: bool
) -> None:
    """The same prompt kept on one pair and split on another: the same text and usage; the split's
    prefill node computed its first k tokens, its decode node pulled them and prefilled the rest
    by the schedule the dispatcher sent."""
    n, k = 300, 192
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt_ids(n), "max_tokens": 6, "temperature": 0, "seed": 7}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with pair(model_dir) as kept, pair(model_dir) as split:
        want = await complete(http, kept.sidecar, body, kept.keep(n, **{c.H_REQUEST_ID: "keep-1"}))
        predicted = {c.H_PRED_TTFT_DECODE_MS: "80.0", c.H_REQUEST_ID: "split-1"}
        got = await complete(http, split.sidecar, body, split.split(k, n, "64,32,12", **predicted))
        assert got == want
        assert got[1]["prompt_tokens"] == n and got[1]["completion_tokens"] == 6

        # The prefill node ran the prompt's first k tokens; the decode node the rest, by its schedule.
        assert sum(t for t, _ in await chunks_of(http, split.prefill, "split-1")) == k
        assert await chunks_of(http, split.decode, "split-1") == [(64, 192), (32, 256), (12, 288)]
        assert await by_source(http, split.decode) == {
            "local_compute": n - k,
            "local_cache_hit": 0,
            "external_kv_transfer": k,
        }
        assert (await by_source(http, split.prefill))["local_compute"] == k
        # A keep's decode node computed nothing; its prefill node the whole prompt.
        assert await chunks_of(http, kept.decode, "keep-1") == []
        assert await by_source(http, kept.decode) == {
            "local_compute": 0,
            "local_cache_hit": 0,
            "external_kv_transfer": n,
        }
        await eventually(lambda: released(http, split.prefill), what="the prefill node freed the pulled KV")

        hop1 = "kairos_sidecar_hop1_seconds_count"
        assert await sidecar_metric(http, split.sidecar, hop1, path="split") == 1
        assert await sidecar_metric(http, split.sidecar, hop1, path="keep") == 0
        ttft = "kairos_sidecar_ttft_seconds_count"
        assert await sidecar_metric(http, split.sidecar, ttft, path="split") == int(stream)
        ratio = "kairos_sidecar_ttft_observed_over_predicted_count"
        assert await sidecar_metric(http, split.sidecar, ratio, path="split") == int(stream)
        for reason in ("prompt_mismatch", "tokenize_failed", "unsupported_prompt", "no_split_connector"):
            assert await sidecar_metric(http, split.sidecar, "kairos_sidecar_split_degraded_total", reason=reason) == 0


async def test_a_chat_request_splits_by_the_local_vllms_tokenize(
    model_dir: Path, http: aiohttp.ClientSession, tokenizer: PromptTokenizer
) -> None:
    """A chat's prompt is its rendered template: the sidecar asks the local vLLM's /tokenize for
    its ids (with the request's template fields) and sends their first k as a completions prompt."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Tell me about disaggregated serving and its KV transfers. " * 8},
        ],
        "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    # The dispatcher's count, as the gateway parses the request.
    n = parse_request("/v1/chat/completions", json.dumps(body).encode(), tokenizer, RequestLimits()).prompt_tokens
    k = (n - 1) // BS * BS
    async with pair(model_dir) as kept, pair(model_dir) as split:
        headers = split.split(k, n, str(n - k), **{c.H_REQUEST_ID: "chat-1"})
        got = await complete(http, split.sidecar, body, headers, "/v1/chat/completions")
        want = await complete(http, kept.sidecar, body, kept.keep(n), "/v1/chat/completions")
        assert got == want and got[1]["prompt_tokens"] == n
        assert sum(t for t, _ in await chunks_of(http, split.prefill, "chat-1")) == k
        assert await chunks_of(http, split.decode, "chat-1") == [(n - k, k)]
        assert (await by_source(http, split.decode))["external_kv_transfer"] == k
        # The chat's prompt as the decode node rendered it starts with the ids the prefill node ran.
        status, tokenized = await post(
            http, f"{split.decode.url}/tokenize", {f: v for f, v in body.items() if f != "max_tokens"}
        )
        assert status == 200 and tokenized["count"] == n


async def test_a_dead_prefill_node_fails_over_to_a_local_prefill(model_dir: Path, http: aiohttp.ClientSession) -> None:
    """Nobody listens where the split's prefill host is: the decode node prefills the whole prompt
    itself, under the step budget the dispatcher sent, and the client gets its answer."""
    dead = f"127.0.0.1:{free_port()}"
    n, k = 200, 128
    async with pair(model_dir, also_allowed=(dead,)) as p:
        headers = p.split(k, n, "72", **{c.H_PREFILL_HOST: dead, c.H_REQUEST_ID: "failover-1"})
        body = {"model": MODEL, "prompt": prompt_ids(n), "max_tokens": 3}
        _, usage = await complete(http, p.sidecar, body, headers)
        assert usage["prompt_tokens"] == n and usage["completion_tokens"] == 3
        assert await chunks_of(http, p.decode, "failover-1") == [(n, 0)]
        assert await by_source(http, p.decode) == {"local_compute": n, "local_cache_hit": 0, "external_kv_transfer": 0}
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_local_prefills_total") == 1
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_hop_errors_total", hop="1", kind="connect") == 1
        assert (await by_source(http, p.prefill))["local_compute"] == 0


async def test_a_prompt_the_node_counts_otherwise_is_served_as_a_keep(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """The dispatcher counted one token more than the node's vLLM sees (a tokenizer mismatch): no
    k tokens can be trusted to be the prompt's, so the whole prompt goes through hop 1, as a keep,
    counted; the request does not fail."""
    n, k = 200, 128
    async with pair(model_dir) as p:
        headers = p.split(k, n + 1, str(n + 1 - k), **{c.H_REQUEST_ID: "mismatch-1"})
        body = {"model": MODEL, "prompt": prompt_ids(n), "max_tokens": 3, "stream": True}
        _, usage = await complete(http, p.sidecar, {**body, "stream_options": {"include_usage": True}}, headers)
        assert usage["prompt_tokens"] == n
        assert (await by_source(http, p.prefill))["local_compute"] == n
        assert await by_source(http, p.decode) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": n}
        degraded = "kairos_sidecar_split_degraded_total"
        assert await sidecar_metric(http, p.sidecar, degraded, reason="prompt_mismatch") == 1
        # Counted as what it was: a keep (its hop 1, its TTFT).
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_hop1_seconds_count", path="keep") == 1
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_ttft_seconds_count", path="keep") == 1
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_ttft_seconds_count", path="split") == 0


async def test_a_tokenizer_the_node_refuses_is_served_as_a_keep(model_dir: Path, http: aiohttp.ClientSession) -> None:
    """A chat whose messages the node's /tokenize refuses: a keep, whose hop 1 gives the client
    vLLM's own answer to its request."""
    async with pair(model_dir) as p:
        body = {"model": MODEL, "messages": "not a list", "max_tokens": 3}
        headers = p.split(16, 40, "24")
        async with http.post(f"{p.sidecar}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"]
        degraded = "kairos_sidecar_split_degraded_total"
        assert await sidecar_metric(http, p.sidecar, degraded, reason="tokenize_failed") == 1


async def test_a_splits_ttft_sample_carries_its_own_prediction(
    model_dir: Path, http: aiohttp.ClientSession, redis: RedisServer
) -> None:
    async with pair(model_dir, redis_url=redis.url) as p:
        n, k = 100, 64
        headers = p.split(k, n, "36", **{c.H_PRED_TTFT_DECODE_MS: "75.5", c.H_PRED_TTFT_PREFILL_MS: "300.0"})
        body = {"model": MODEL, "prompt": prompt_ids(n), "max_tokens": 2, "stream": True}
        async with http.post(f"{p.sidecar}/v1/completions", json=body, headers={**headers, c.H_REQUEST_ID: "s-1"}) as r:
            assert r.status == 200
            await r.read()
        client = aioredis.Redis.from_url(redis.url, decode_responses=True)
        try:

            async def entries() -> list[dict[str, str]]:
                return [f for _, f in await client.xrange(c.REDIS_TTFT_FEEDBACK_STREAM)]

            (entry,) = await eventually(entries, what="the split's TTFT sample")
        finally:
            await client.aclose()
        assert (entry["request_id"], entry["path"], entry["node"], entry["predicted_ms"]) == (
            "s-1",
            "split",
            "d0",
            "75.500",
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_split_the_decode_nodes_vllm_refuses_is_served_as_a_keep(
    model_dir: Path, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """The decode node's vLLM runs stock NixlConnector: its validator refuses the split's decode
    hop with a 400 (a streamed one: a 200 whose one event is the error). No byte of that reaches
    the client: the sidecar sends the whole prompt through hop 1 as a keep's, then hop 2 with its
    params, and counts it; the second such request is counted, not logged again."""
    caplog.set_level(logging.WARNING, logger="kairos.nodeagent.sidecar")
    n, k = 200, 128
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt_ids(n, seed=11), "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with pair(model_dir, decode_node={"split_connector": False}) as p:
        predicted = {c.H_PRED_TTFT_DECODE_MS: "80.0", c.H_PRED_TTFT_PREFILL_MS: "120.0"}
        headers = p.split(k, n, "72", **predicted, **{c.H_REQUEST_ID: "refused-1"})
        async with http.post(f"{p.sidecar}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.read()
        assert b'"error"' not in raw
        text, usage = await complete(http, p.sidecar, body, p.keep(n, **{c.H_REQUEST_ID: "kept-1"}))
        if stream:
            events = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
            assert raw.endswith(b"data: [DONE]\n\n")
            assert "".join(ch["text"] for e in events for ch in e["choices"]) == text
            assert [e["usage"] for e in events if e.get("usage")] == [usage]
        else:
            reply = json.loads(raw)
            assert (reply["choices"][0]["text"], reply["usage"]) == (text, usage)
        assert usage["prompt_tokens"] == n and usage["completion_tokens"] == 4

        # The decode node computed nothing of it: it pulled the whole prompt, as a keep's decode node.
        assert await chunks_of(http, p.decode, "refused-1") == []
        assert (await by_source(http, p.decode))["local_compute"] == 0
        # The prefill node ran the split's first k, then the keep's prompt past them (cached by then).
        assert [t for t, _ in await chunks_of(http, p.prefill, "refused-1")] == [k, n - k]

        degraded = "kairos_sidecar_split_degraded_total"
        assert await sidecar_metric(http, p.sidecar, degraded, reason="no_split_connector") == 1
        hop1 = "kairos_sidecar_hop1_seconds_count"
        assert await sidecar_metric(http, p.sidecar, hop1, path="keep") == 2  # this one and the plain keep
        assert await sidecar_metric(http, p.sidecar, hop1, path="split") == 0
        ttft = "kairos_sidecar_ttft_seconds_count"
        assert await sidecar_metric(http, p.sidecar, ttft, path="split") == 0
        assert await sidecar_metric(http, p.sidecar, ttft, path="keep") == 2 * int(stream)
        assert await sidecar_metric(http, p.sidecar, "kairos_sidecar_local_prefills_total") == 0

        # The next split is served as a keep at once: no split hop 1 leaves KV held on the prefill node.
        again = {**body, "prompt": prompt_ids(n, seed=12)}
        await complete(http, p.sidecar, again, p.split(k, n, "72", **{c.H_REQUEST_ID: "refused-2"}))
        assert await chunks_of(http, p.prefill, "refused-2") == [(n, 0)]
        assert await sidecar_metric(http, p.sidecar, degraded, reason="no_split_connector") == 2
    logged = [r for r in caplog.records if "refused a split's decode hop" in r.getMessage()]
    assert len(logged) == 1 and "kv_connector_module_path" in logged[0].getMessage()


async def test_a_node_that_refused_a_split_is_asked_again_after_a_while(
    model_dir: Path, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its vLLM may have been restarted with the split connector since: once the retry window is
    over (none here), the next split is tried again (and refused again, as this node still is)."""
    monkeypatch.setattr(sidecar_app, "SPLIT_REFUSED_RETRY_S", 0.0)
    n, k = 200, 128
    async with pair(model_dir, decode_node={"split_connector": False}) as p:
        for i in range(2):
            body = {"model": MODEL, "prompt": prompt_ids(n, seed=20 + i), "max_tokens": 2}
            _, usage = await complete(http, p.sidecar, body, p.split(k, n, "72", **{c.H_REQUEST_ID: f"again-{i}"}))
            assert usage["prompt_tokens"] == n
            assert [t for t, _ in await chunks_of(http, p.prefill, f"again-{i}")] == [k, n - k]
        degraded = "kairos_sidecar_split_degraded_total"
        assert await sidecar_metric(http, p.sidecar, degraded, reason="no_split_connector") == 2


# ---------------------------------------------------------------------------------------------
# The emulated nodes alone: vLLM's wire protocol of a split
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cached", "pulled"), [(64, 64), (176, 0)])
async def test_a_decode_node_takes_its_cached_prefix_and_pulls_only_the_rest_of_k(
    model_dir: Path, http: aiohttp.ClientSession, cached: int, pulled: int
) -> None:
    """As NixlConnector, the decode node takes the prompt's prefix from its own cache and pulls
    only the blocks of the first k tokens it lacks (none, when its hit covers k); it prefills the
    rest of the prompt from there, by the schedule."""
    n, k = 300, 128
    ids = prompt_ids(n, seed=3)
    async with running(model_dir, "p0", Role.PREFILL) as prefill, running(model_dir, "d0", Role.DECODE) as decode:
        # An earlier turn on the decode node: its first cached + 1 tokens, whose full blocks stay cached.
        status, _ = await post(http, f"{decode.url}/v1/completions", {"model": MODEL, "prompt": ids[: cached + 1]})
        assert status == 200
        before = await by_source(http, decode)
        hop1 = {"model": MODEL, "prompt": ids[:k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1)
        assert status == 200, reply
        kv = reply["kv_transfer_params"]
        assert kv["remote_num_tokens"] == k and len(kv["remote_block_ids"][0]) == k // BS
        hop2 = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 2,
            "kv_transfer_params": kv,
            "vllm_xargs": {c.XARG_CHUNK_SCHEDULE: [100], c.XARG_STEP_BUDGET_MS: 5000.0},
        }
        status, done = await post(http, f"{decode.url}/v1/completions", hop2, **{c.H_REQUEST_ID: "cached-1"})
        assert status == 200, done
        assert done["usage"]["prompt_tokens"] == n and done["usage"]["completion_tokens"] == 2
        after = await by_source(http, decode)
        start = max(cached, k)
        assert {s: after[s] - before[s] for s in after} == {
            "local_compute": n - start,
            "local_cache_hit": cached,
            "external_kv_transfer": pulled,
        }
        rest = n - start
        assert await chunks_of(http, decode, "cached-1") == [
            (min(100, rest - i), start + i) for i in range(0, rest, 100)
        ]
        await eventually(lambda: released(http, prefill), what="the prefill node freed the claimed KV")


async def test_a_split_decode_hop_streams_and_its_pull_is_refused_when_it_claims_too_much(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """remote_num_tokens past the prompt is a prefill of another prompt: vLLM's 400, nothing runs."""
    n, k = 120, 64
    ids = prompt_ids(n, seed=5)
    async with running(model_dir, "p0", Role.PREFILL) as prefill, running(model_dir, "d0", Role.DECODE) as decode:
        hop1 = {"model": MODEL, "prompt": ids[:k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1)
        assert status == 200
        kv = reply["kv_transfer_params"]
        short = {"model": MODEL, "prompt": ids[: k - 1], "max_tokens": 2, "kv_transfer_params": kv}
        status, err = await post(http, f"{decode.url}/v1/completions", short)
        assert status == 400 and "the prefill ran another prompt" in err["error"]["message"]
        body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "stream": True, "kv_transfer_params": kv}
        body["vllm_xargs"] = {c.XARG_CHUNK_SCHEDULE: [n - k]}
        async with http.post(f"{decode.url}/v1/completions", json=body, headers={c.H_REQUEST_ID: "st-1"}) as resp:
            assert resp.status == 200
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"finish_reason"') == 3
        assert await chunks_of(http, decode, "st-1") == [(n - k, k)]


async def test_a_node_without_the_split_connector_refuses_a_splits_decode_hop_as_its_validator_does(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """Its vLLM's validator plugin answers a split's decode hop with a 400 naming the fix (a
    streamed one with a 200 whose one event is that error, as vLLM validates after a stream's
    headers), before the engine sees it; a keep's decode hop is served. The sidecar knows both."""
    n, k = 120, 64
    ids = prompt_ids(n, seed=9)
    async with (
        running(model_dir, "p0", Role.PREFILL) as prefill,
        running(model_dir, "d0", Role.DECODE, split_connector=False) as decode,
    ):
        hop1 = {"model": MODEL, "prompt": ids[:k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1)
        assert status == 200
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 2,
            "kv_transfer_params": reply["kv_transfer_params"],
            "vllm_xargs": {c.XARG_CHUNK_SCHEDULE: [n - k]},
        }
        message = split_refusal(describe_connector(SPLIT_CONNECTOR, None))
        error = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        async with http.post(f"{decode.url}/v1/completions", json=body, headers={c.H_REQUEST_ID: "no-1"}) as resp:
            raw = await resp.read()
            assert (resp.status, resp.content_type, json.loads(raw)) == (400, "application/json", error)
            assert is_split_refused(resp.status, raw)
        async with http.post(f"{decode.url}/v1/completions", json={**body, "stream": True}) as resp:
            raw = await resp.read()
            assert (resp.status, resp.content_type) == (200, "text/event-stream")
            assert raw == f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            assert is_split_refused(resp.status, raw)
        assert await chunks_of(http, decode, "no-1") == []
        assert await by_source(http, decode) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}

        # A keep's decode hop (the whole prompt computed on the prefill node, no schedule) is served.
        hop1["prompt"] = ids
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1)
        assert status == 200
        keep = {"model": MODEL, "prompt": ids, "max_tokens": 2, "kv_transfer_params": reply["kv_transfer_params"]}
        status, done = await post(http, f"{decode.url}/v1/completions", keep)
        assert status == 200 and done["usage"]["completion_tokens"] == 2
        assert (await by_source(http, decode))["external_kv_transfer"] == n


async def test_a_split_whose_kv_is_on_its_way_is_reported_as_the_vllm_plugin_reports_it(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """From its decode hop's arrival until its pull ends, a split is a pending KV pull of its k
    tokens and a scheduled prefill of the other l - k with k computed, after the scheduled prefills
    the node has admitted (a deflection in progress here), its TPOT counted among the node's: the
    fields and values of the vLLM plugin's state (build_state over the rows KairosScheduler makes).
    The link is held meanwhile; once it is free, the split lands and prefills its rest."""
    n, k, tpot_ms = 300, 128, 40.0
    ids = prompt_ids(n, seed=13)
    # A slow node: the deflection's one-token chunks keep it in progress for the whole test.
    async with (
        running(model_dir, "p0", Role.PREFILL) as prefill,
        running(model_dir, "d0", Role.DECODE, time_scale=2.0) as decode,
    ):
        hop1 = {"model": MODEL, "prompt": ids[:k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1)
        assert status == 200
        deflected = {
            "model": MODEL,
            "prompt": prompt_ids(4000, seed=14),
            "max_tokens": 1,
            "vllm_xargs": {c.XARG_CHUNK_SCHEDULE: [1]},
        }
        split = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 2,
            "kv_transfer_params": reply["kv_transfer_params"],
            "vllm_xargs": {c.XARG_CHUNK_SCHEDULE: [n - k], c.XARG_STEP_BUDGET_MS: 5000.0, c.XARG_TPOT_SLO_MS: tpot_ms},
        }
        tasks: list[asyncio.Task[Any]] = []
        try:
            tasks.append(asyncio.create_task(post(http, f"{decode.url}/v1/completions", deflected)))

            async def deflection_started() -> dict[str, Any] | None:
                state = await get_json(http, f"{decode.url}/kairos/state")
                computed = state["scheduled_prefill_computed_tokens"]
                return state if computed and computed[0] > 0 else None

            await eventually(deflection_started, what="the deflection in progress")
            async with decode.node._link:  # the link is busy: the split's pull waits on it
                tasks.append(asyncio.create_task(post(http, f"{decode.url}/v1/completions", split)))

                async def pulling() -> dict[str, Any] | None:
                    state = await get_json(http, f"{decode.url}/kairos/state")
                    return state if state["pending_kv_pull_tokens"] else None

                state = await eventually(pulling, what="the split's pull in the state")
                (remaining,), (computed,) = (
                    state["scheduled_prefill_tokens"][:-1],
                    state["scheduled_prefill_computed_tokens"][:-1],
                )
                assert remaining > 0 and computed > 0  # the deflection, still in progress
                plugin = build_state(
                    decode_tokens=state["decode_tokens"],
                    kv_tokens=state["kv_tokens"],
                    kv_capacity_tokens=state["kv_capacity_tokens"],
                    # KairosScheduler's rows: its running prefills, then the split waiting for its KV
                    prefills=[PendingPrefill(remaining, True, computed), PendingPrefill(n - k, True, k)],
                    max_step_tokens=state["max_step_tokens"],
                    model=MODEL,
                    running_requests=1,
                    waiting_requests=1,
                    kv_usage=0.0,
                    kv_pulls=[k],
                    tpot_slo_s=tpot_ms / 1e3,  # the tightest: the deflection counts the cluster's 50 ms
                )
                fields = (
                    "queued_prefill_tokens",
                    "queued_prefill_computed_tokens",
                    "scheduled_prefill_tokens",
                    "scheduled_prefill_computed_tokens",
                    "pending_kv_pull_tokens",
                    "tpot_slo_ms",
                )
                assert {f: state[f] for f in fields} == {f: _as_json(getattr(plugin, f)) for f in fields}

            async def landed() -> dict[str, Any] | None:
                state = await get_json(http, f"{decode.url}/kairos/state")
                return state if not state["pending_kv_pull_tokens"] else None

            state = await eventually(landed, what="the split's KV landed")
            # Admitted now, behind the deflection in progress, with its k computed.
            assert state["scheduled_prefill_tokens"][-1] == n - k
            assert state["scheduled_prefill_computed_tokens"][-1] == k
            assert state["tpot_slo_ms"] == tpot_ms
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task


def _as_json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
