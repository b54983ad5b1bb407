"""Batch prompts and n > 1 end to end through real Envoy, the dispatcher, the sidecars and 2P2D
emulated vLLM nodes: a decode sidecar fans such a request out back through Envoy, one request per
prompt and choice (vLLM's engine requests), each with a routing decision of its own, and merges
the answers into vLLM's one answer."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import openai

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster
from tests.e2e.conftest import decisions, http, post_json, text_of

MODEL = "kairos-tiny-llama"


def rid() -> str:
    return f"batch-{uuid.uuid4().hex[:12]}"


def decided(cluster: LocalCluster) -> float:
    """Routing decisions the dispatcher has made so far (every route and reason)."""
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in raw.decode().splitlines()
        if line.startswith("kairos_dispatcher_decisions_total{")
    )


def test_a_batch_of_strings_gets_one_decision_per_prompt_and_vllms_one_answer(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    prompts = [text_of(tokenizer, 300), text_of(tokenizer, 1200), text_of(tokenizer, 60)]
    request_id = rid()
    status, headers, body = post_json(
        f"{cluster.gateway_url}/v1/completions",
        {"model": MODEL, "prompt": prompts, "max_tokens": 5},
        {"x-request-id": request_id},
        timeout=120,
    )
    assert status == 200, body
    assert headers[c.H_ROUTE] == c.ROUTE_FANOUT and body["id"] == f"cmpl-{request_id}"
    # Each prompt came back through Envoy as its own request and was decided on its own.
    parts = decisions(cluster, [f"{request_id}-{i}" for i in range(3)])
    assert {parts[f"{request_id}-{i}"][2] for i in range(3)} <= {"keep", "deflect"}
    counts = [tokenizer.count_completion_prompt(p) for p in prompts]
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert {ch["finish_reason"] for ch in body["choices"]} == {"length"}
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        sum(counts),
        15,
        sum(counts) + 15,
    )
    # The choice of prompt i is prompt i's own answer.
    for i, prompt in enumerate(prompts):
        _, _, alone = post_json(
            f"{cluster.gateway_url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5}
        )
        assert body["choices"][i]["text"] == alone["choices"][0]["text"]
        assert alone["usage"]["prompt_tokens"] == counts[i]


def test_a_batch_of_token_id_lists_through_the_openai_sdk(cluster: LocalCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    prompts = [[11 + i % 50 for i in range(n)] for n in (40, 400, 7, 90)]
    before = decided(cluster)
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, temperature=0.7)
    assert [ch.index for ch in done.choices] == list(range(8))  # prompt p's choice j is p * 2 + j
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (sum(len(p) for p in prompts), 4 * 2 * 3)
    assert decided(cluster) - before == 8  # one decision per prompt and choice, none for the batch


def test_a_streamed_batch_carries_each_choices_index_one_usage_chunk_and_one_done(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    prompts = [text_of(tokenizer, 200), text_of(tokenizer, 500)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "stream": True}
    status, headers, raw = http(
        "POST",
        f"{cluster.gateway_url}/v1/completions",
        json.dumps({**body, "stream_options": {"include_usage": True}}).encode(),
        {"content-type": "application/json"},
        timeout=120,
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({ch["id"] for ch in chunks}) == 1
    tokens, usage = chunks[:-1], chunks[-1]
    assert Counter(ch["choices"][0]["index"] for ch in tokens) == {0: 4, 1: 4}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens"] == sum(tokenizer.count_completion_prompt(p) for p in prompts)

    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1] and all(texts.values())


def test_n_choices_through_the_gateway_as_vllm_serves_them(cluster: LocalCluster, tokenizer: PromptTokenizer) -> None:
    prompt = text_of(tokenizer, 800)
    expected = tokenizer.count_completion_prompt(prompt)
    request_id = rid()
    status, headers, body = post_json(
        f"{cluster.gateway_url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 3, "seed": 5},
        {"x-request-id": request_id},
    )
    assert status == 200, body
    assert headers[c.H_ROUTE] == c.ROUTE_FANOUT
    parts = decisions(cluster, [f"{request_id}-{j}" for j in range(3)])  # each choice decided on its own
    assert {route for _, _, route, _ in parts.values()} <= {"keep", "deflect"}
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (expected, 12)

    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert Counter(ch.choices[0].index for ch in chunks if ch.choices) == {0: 3, 1: 3}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_a_batch_with_one_bad_prompt_is_refused_whole_and_nothing_is_routed(cluster: LocalCluster) -> None:
    before = decided(cluster)
    bad: list[dict[str, Any]] = [
        {"prompt": [[5, 6, 7], [5, 99999]]},  # a token id out of the vocabulary
        {"prompt": [[5, 6, 7], [5] * 40_000]},  # past the context
        {"prompt": ["a", [5]]},  # mixed forms
        {"prompt": ["a", "b"], "n": 2, "temperature": 0},  # greedy with n 2
    ]
    for fields in bad:
        status, _, body = post_json(
            f"{cluster.gateway_url}/v1/completions", {"model": MODEL, "max_tokens": 2, **fields}
        )
        assert status == 400, (fields, body)
        assert body["error"]["type"] == "invalid_request_error"
    assert decided(cluster) == before
