"""Dispatcher.route with a batch (several prompts in one completions body): every prompt checked
as vLLM checks it, then the batch goes whole to a decode sidecar to fan out (``x-kairos-route:
fanout``); nothing is decided, recorded or reserved for it (each prompt is, when it comes back)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.core.latency import load_profile
from kairos.core.policies import create_policy
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings, Rejected, RequestHead, Routed
from kairos.extproc.metrics import DispatcherMetrics
from kairos.launcher.tinymodel import build_tiny_model
from tests.unit.test_dispatcher import (
    COMPLETIONS,
    OWNER,
    SIDECAR,
    TOKEN_ID,
    FakeCluster,
    Harness,
    error_of,
    headers_of,
    make_cluster,
)

HarnessFactory = Callable[[FakeCluster], Harness]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("dispatcher-batch-model"))
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture
def harness(tokenizer: PromptTokenizer) -> Iterator[HarnessFactory]:
    built: list[Dispatcher] = []
    models = load_profile()

    def build(cluster: FakeCluster) -> Harness:
        metrics = DispatcherMetrics(CollectorRegistry())
        policy, keep = create_policy("kairos", models), create_policy("pd", models)
        dispatcher = Dispatcher(tokenizer, policy, keep, cluster, metrics, DispatchSettings(dispatcher_id=OWNER))
        built.append(dispatcher)
        return Harness(dispatcher, cluster, metrics)

    yield build
    for dispatcher in built:
        dispatcher.close()


def batch_body(*lengths: int, **extra: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": [[TOKEN_ID] * n for n in lengths], "max_tokens": 4, **extra}).encode()


async def test_a_batch_goes_whole_to_decode_sidecars_in_turn_undecided(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    head = RequestHead.of("POST", COMPLETIONS, {"x-request-id": "b-7", "x-kairos-chunk-schedule": "1"})
    first = await h.dispatcher.route(head, batch_body(100, 200, 300))
    second = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), batch_body(5, 6))

    assert isinstance(first, Routed) and isinstance(second, Routed)
    assert first.decision is None
    assert first.destinations == (SIDECAR["d0"], SIDECAR["d1"])
    assert second.destinations == (SIDECAR["d1"], SIDECAR["d0"])
    assert headers_of(first) == {c.H_REQUEST_ID: "b-7", c.H_ROUTE: c.ROUTE_FANOUT, c.H_PROMPT_TOKENS: "600"}
    assert first.remove_headers == ("x-kairos-chunk-schedule",)  # the client's routing headers go
    assert h.cluster.recorded == [] and h.cluster.reservations == []
    assert h.sample("kairos_dispatcher_fanouts_total") == 2
    assert h.sample("kairos_dispatcher_fanout_parts_total") == 5
    assert h.sample("kairos_dispatcher_decision_seconds_count") == 0


async def test_n_choices_fan_out_one_request_per_choice(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    body = json.dumps({"model": "tiny", "prompt": [TOKEN_ID] * 500, "max_tokens": 4, "n": 3}).encode()
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), body)
    assert isinstance(routed, Routed) and routed.decision is None
    assert headers_of(routed)[c.H_ROUTE] == c.ROUTE_FANOUT
    both = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), batch_body(5, 6, n=2))
    assert isinstance(both, Routed) and headers_of(both)[c.H_ROUTE] == c.ROUTE_FANOUT
    assert h.sample("kairos_dispatcher_fanout_parts_total") == 3 + 2 * 2
    assert h.cluster.recorded == [] and h.cluster.reservations == []


async def test_one_prompt_in_a_list_is_decided_as_one_prompt(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), batch_body(4000))
    assert isinstance(routed, Routed) and routed.decision is not None
    assert headers_of(routed)[c.H_ROUTE] == "keep"
    assert h.sample("kairos_dispatcher_fanouts_total") == 0


async def test_a_batch_with_one_bad_prompt_is_refused_whole(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    body = json.dumps({"model": "tiny", "prompt": [[TOKEN_ID] * 10, [TOKEN_ID] * 40_000], "max_tokens": 4}).encode()
    refused = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), body)
    assert isinstance(refused, Rejected) and refused.status == 400
    assert "maximum context length" in error_of(refused)["message"]
    greedy = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), batch_body(3, 4, n=2, temperature=0))
    assert (
        isinstance(greedy, Rejected) and error_of(greedy)["message"] == "n must be 1 when using greedy sampling, got 2."
    )
    assert h.sample("kairos_dispatcher_fanouts_total") == 0 and h.cluster.recorded == []


async def test_a_batch_with_no_decode_node_is_503(harness: HarnessFactory) -> None:
    h = harness(make_cluster(decode=False))
    refused = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), batch_body(3, 4))
    assert isinstance(refused, Rejected) and refused.status == 503
