"""The split route through the whole gateway (Envoy, the dispatcher, the sidecar, emulated vLLM
nodes): a cluster with the split on (``split=offload``; the default is off, see
docs/design/split.md) splits a long prompt on an idle 1P1D cluster, where the deflection is
slower than alpha x the keep path and a split of it is not. The prefill node computes the first
k tokens, the decode node pulls them and prefills the rest by the dispatcher's schedule, and the
answer is the one a keep of the same prompt gets."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.contracts.routes import Route
from kairos.launcher.local_cluster import LocalCluster
from tests.e2e.conftest import http, post_json, start_cluster, steps_of, text_of

MODEL = "kairos-tiny-llama"


@pytest.fixture(scope="module")
def split_cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    cluster = start_cluster(
        tmp_path_factory.mktemp("split"), model_dir, prefill_nodes=1, decode_nodes=1, split="offload"
    )
    yield cluster
    cluster.stop()


def _rid() -> str:
    return f"e2e-split-{uuid.uuid4().hex[:12]}"


def test_a_long_prompt_splits_its_first_k_tokens_on_p0_and_the_rest_on_d0(
    split_cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    prompt = text_of(tokenizer, 6000)
    request_id = _rid()
    status, headers, body = post_json(
        f"{split_cluster.gateway_url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0},
        {c.H_REQUEST_ID: request_id},
    )
    assert status == 200, body
    assert headers[c.H_ROUTE] == Route.SPLIT.value  # echoed for operators, with k and the schedule
    prompt_tokens = body["usage"]["prompt_tokens"]
    k = c.parse_split_tokens(headers[c.H_SPLIT_TOKENS], prompt_tokens)
    schedule = c.parse_chunk_schedule_header(headers[c.H_CHUNK_SCHEDULE])
    assert sum(schedule) == prompt_tokens - k
    assert float(headers[c.H_PRED_TTFT_DECODE_MS]) <= 1.3 * float(headers[c.H_PRED_TTFT_PREFILL_MS])  # Eq. 7's bound
    # p0 computed exactly the first k tokens; d0 pulled them and computed the rest, chunk by chunk.
    assert sum(steps_of(split_cluster, "p0", request_id)) == k
    assert steps_of(split_cluster, "d0", request_id) == list(schedule)
    _, _, metrics = http("GET", f"http://{split_cluster.node('d0').url}/metrics")
    assert 'source="external_kv_transfer"' in metrics.decode()

    # The same prompt sent to d0 alone (no routing headers: plain aggregated serving) answers alike.
    status, _, alone = post_json(
        f"http://{split_cluster.node('d0').url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0},
    )
    assert status == 200
    assert [ch["text"] for ch in body["choices"]] == [ch["text"] for ch in alone["choices"]]
    assert body["usage"] == {**alone["usage"], "prompt_tokens_details": body["usage"].get("prompt_tokens_details")}


def test_a_streamed_chat_request_splits_too(split_cluster: LocalCluster, tokenizer: PromptTokenizer) -> None:
    request_id = _rid()
    status, headers, raw = http(
        "POST",
        f"{split_cluster.gateway_url}/v1/chat/completions",
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 4, "stream": true}'
            % (MODEL.encode(), text_of(tokenizer, 6000).encode())
        ),
        {"content-type": "application/json", c.H_REQUEST_ID: request_id},
        60,
    )
    assert status == 200, raw[:300]
    assert headers[c.H_ROUTE] == Route.SPLIT.value
    assert raw.rstrip().endswith(b"data: [DONE]")
    k = int(headers[c.H_SPLIT_TOKENS])
    assert sum(steps_of(split_cluster, "p0", request_id)) == k
    assert sum(steps_of(split_cluster, "d0", request_id)) == sum(
        c.parse_chunk_schedule_header(headers[c.H_CHUNK_SCHEDULE])
    )
