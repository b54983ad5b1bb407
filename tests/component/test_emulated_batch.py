"""The emulated vLLM node serves batch prompts and n > 1 as vLLM 0.32 does: one engine request per
prompt, n sequences per prompt (vLLM's child requests, ids "<choice>_<id>"), one answer with each
choice's index (prompt p's choice j is p * n + j), usage counting each prompt once and every
choice's tokens; streamed chunks carry their index, one usage chunk and one [DONE] close a stream."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.common.contracts import Role
from kairos.launcher.tinymodel import build_tiny_model
from tests.component.test_emulated_vllm import MODEL, Node, get_json, ids, post, running
from tests.waiting import eventually


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def decode(model_dir: Path) -> AsyncIterator[Node]:
    async with running(model_dir, "d0", Role.DECODE, enable_prompt_tokens_details=True) as node:
        yield node


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE events' payloads, parsed ("[DONE]" kept as the string)."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def chunks_by_request(http: aiohttp.ClientSession, node: Node) -> Counter[str]:
    steps = (await get_json(http, f"{node.url}/kairos/steps?since=0"))["steps"]
    return Counter(c["request_id"] for s in steps for c in s["chunks"])


async def test_n_choices_run_as_n_sequences_and_usage_counts_the_prompt_once(
    decode: Node, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": ids(40), "max_tokens": 3, "n": 3}
    status, out = await post(http, f"{decode.url}/v1/completions", body, **{"X-Request-Id": "n3"})
    assert status == 200, out
    assert out["id"] == "cmpl-n3"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert {c["finish_reason"] for c in out["choices"]} == {"length"}
    assert all(c["text"] == "".join(decode.node.words[:3]) for c in out["choices"])
    assert {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": 40,
        "completion_tokens": 9,
        "total_tokens": 49,
    }
    # Three engine requests, vLLM's child ids, each prefilled (the emulated cache stores a
    # prompt's blocks as they are computed, so the siblings submitted beside it find none).
    assert set(await chunks_by_request(http, decode)) == {"0_n3", "1_n3", "2_n3"}


async def test_streamed_n_choices_carry_their_index_and_one_usage_chunk(
    decode: Node, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": ids(30), "max_tokens": 4, "n": 2, "stream": True}
    events = await stream(http, f"{decode.url}/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    tokens = [e for e in events[:-1] if e["choices"]]
    assert Counter(e["choices"][0]["index"] for e in tokens) == {0: 4, 1: 4}
    assert [e["choices"][0]["finish_reason"] for e in tokens].count("length") == 2
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens"] == 30 and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_a_chat_stream_with_n_choices_sends_a_role_chunk_per_choice_first(
    decode: Node, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "stream": True}
    events = await stream(http, f"{decode.url}/v1/chat/completions", body)
    roles = events[:2]
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in roles] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    assert Counter(e["choices"][0]["index"] for e in events[2:-1]) == {0: 2, 1: 2}
    status, out = await post(http, f"{decode.url}/v1/chat/completions", {**body, "stream": False})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "prompts",
    [
        pytest.param(["the quick brown fox", "a lazy dog sleeps all day"], id="strings"),
        pytest.param([ids(12), ids(25), ids(7)], id="token-id lists"),
    ],
)
async def test_a_batch_runs_one_request_per_prompt_and_answers_in_prompt_order(
    decode: Node, http: aiohttp.ClientSession, tokenizer: PromptTokenizer, prompts: list[Any]
) -> None:
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "n": 2, "temperature": 0.8}
    status, out = await post(http, f"{decode.url}/v1/completions", body, **{"X-Request-Id": "b1"})
    assert status == 200, out
    assert out["id"] == "cmpl-b1" and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == list(range(2 * len(prompts)))
    counts = [tokenizer.count_completion_prompt(p) for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(counts)  # each prompt once, whatever its n
    assert out["usage"]["completion_tokens"] == 2 * 2 * len(prompts)
    assert out["usage"]["total_tokens"] == sum(counts) + 4 * len(prompts)
    # The last prompt's cache report, as vLLM's (its last RequestOutput's num_cached_tokens).
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    expected = {f"{j}_b1-{i}" for i in range(len(prompts)) for j in range(2)}
    assert set(await chunks_by_request(http, decode)) == expected


async def test_a_streamed_batch_interleaves_its_prompts_with_batch_indices_and_sums_usage(
    decode: Node, http: aiohttp.ClientSession
) -> None:
    body = {
        "model": MODEL,
        "prompt": [ids(10), ids(20)],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await stream(http, f"{decode.url}/v1/completions", body)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    usage_chunks = [e for e in events[:-1] if not e["choices"]]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-2]
    assert usage_chunks[0]["usage"] == {
        "prompt_tokens": 30,
        "total_tokens": 36,
        "completion_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    tokens = [e for e in events[:-2]]
    assert {e["id"] for e in events[:-1]} == {tokens[0]["id"]}
    assert Counter(e["choices"][0]["index"] for e in tokens) == {0: 3, 1: 3}


async def test_a_batch_with_one_bad_prompt_is_refused_whole_before_anything_runs(
    decode: Node, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": [ids(10), [99999]], "max_tokens": 2}
    status, out = await post(http, f"{decode.url}/v1/completions", body)
    assert status == 400 and "token id 99999 is out of vocabulary" in out["error"]["message"]
    status, out = await post(http, f"{decode.url}/v1/completions", {**body, "prompt": "x", "n": 2, "temperature": 0})
    assert status == 400 and out["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
    assert await chunks_by_request(http, decode) == Counter()


async def test_n_choices_on_the_two_hop_path_as_vllm_runs_them(model_dir: Path, http: aiohttp.ClientSession) -> None:
    """A prefill hop with n 2 holds two copies of the KV and names the last to finish (the other
    waits, unread, for its hold to time out); a decode hop with n 2 serves both choices from that
    one prefill's KV, each child reading it (one claim)."""
    async with (
        running(model_dir, "p0", Role.PREFILL, kv_hold_timeout_s=0.5) as prefill,
        running(model_dir, "d0", Role.DECODE) as decode,
    ):
        client = {"model": MODEL, "prompt": ids(48), "max_tokens": 3, "n": 2}
        hop1 = {**client, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply = await post(http, f"{prefill.url}/v1/completions", hop1, **{"X-Request-Id": "k2"})
        assert status == 200, reply
        assert len(reply["choices"]) == 2
        params = reply["kv_transfer_params"]
        assert params["remote_request_id"] in {"0_k2", "1_k2"}
        assert (await get_json(http, f"{prefill.url}/kairos/state"))["kv_tokens"] == 2 * 49  # both held

        status, done = await post(http, f"{decode.url}/v1/completions", {**client, "kv_transfer_params": params})
        assert status == 200, done
        assert [c["index"] for c in done["choices"]] == [0, 1]
        assert done["usage"]["completion_tokens"] == 6 and done["usage"]["prompt_tokens"] == 48

        async def released() -> bool:  # the read copy once read, the other at its hold's end
            return (await get_json(http, f"{prefill.url}/kairos/state"))["kv_tokens"] == 0

        await eventually(released, what="both prefill copies released")
