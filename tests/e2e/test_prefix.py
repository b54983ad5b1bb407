"""Prefix caches through the whole gateway: real Envoy, Redis, the dispatcher, sidecars, heartbeat
publishers and emulated nodes, with d1's heartbeat advertising a test publisher that speaks
vLLM's KV event wire format (tests/kv_publisher.py) and plays d1's prefix cache (the other nodes
publish their own, emulated, caches): a prompt whose blocks it stores is deflected to d1 over its
uncached tokens; once the publisher restarted (sequence numbers from 0, its cache empty) or is
gone, a prompt it held reads no hit and keeps.

A 6,000-token prompt keeps on the idle cluster (tests/e2e/test_gateway.py says why).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster, kv_events_config
from tests.e2e.conftest import http, post_json, text_of, wait_for_fresh_polls
from tests.kv_publisher import BLOCK_SIZE, VllmEventPublisher
from tests.waiting import wait_until

MODEL = "kairos-tiny-llama"


@pytest.fixture
def publishers() -> Iterator[list[VllmEventPublisher]]:
    started: list[VllmEventPublisher] = []
    yield started
    for pub in started:
        pub.close()


def kv_state(cluster: LocalCluster, node_id: str) -> dict[str, Any] | None:
    """``node_id``'s KV event subscription in dispatcher 0's ``/nodes`` (None: not subscribed)."""
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}/nodes", timeout=10)
    node = next((n for n in json.loads(raw)["nodes"] if n["id"] == node_id), None)
    return None if node is None else node.get("kv_events")


def advertise(cluster: LocalCluster, node_id: str, pub: VllmEventPublisher) -> None:
    """Restart the node's heartbeat publisher advertising ``pub``'s sockets, as a node started
    with vLLM's --kv-events-config on those ports would; wait until the dispatcher is in step."""
    node = cluster.node(node_id)
    assert node.publisher is not None
    node.publisher.stop()
    node.kv_events = kv_events_config(*pub.ports)
    node.publisher = cluster.start_publisher(node)
    wait_until(
        lambda: (
            (s := kv_state(cluster, node_id)) and s["endpoint"] == pub.endpoints.pub and s["connected"] and s["synced"]
        ),
        what=f"{node_id}'s events subscribed and in step",
    )


def store_until_indexed(
    cluster: LocalCluster, pub: VllmEventPublisher, ids: list[int], blocks: Callable[[int], bool]
) -> None:
    """Publish the blocks of ``ids`` until d1's index holds ``blocks`` (a batch sent while the
    subscription is still on its way is dropped at the PUB socket, and nothing after it shows a gap)."""

    def indexed() -> bool:
        state = kv_state(cluster, "d1")
        if state is not None and blocks(state["cached_blocks"]):
            return True
        pub.store(ids)
        return False

    pub.store(ids)
    wait_until(indexed, what="d1's blocks in the dispatcher's index", interval_s=0.2)


def complete(cluster: LocalCluster, prompt: str) -> tuple[dict[str, str], dict[str, Any]]:
    status, headers, body = post_json(
        f"{cluster.gateway_url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 4},
        {"x-request-id": f"e2e-{uuid.uuid4().hex[:12]}"},
    )
    assert status == 200, body
    return headers, body


def test_a_prompt_cached_on_d1_deflects_there_until_its_publisher_is_gone_or_restarted(
    cluster: LocalCluster, tokenizer: PromptTokenizer, publishers: list[VllmEventPublisher]
) -> None:
    prompt = text_of(tokenizer, 6000)
    ids = tokenizer.completion_prompt_ids(prompt)  # what the dispatcher and vLLM hash
    cached = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM never hits the last token
    pub = VllmEventPublisher()
    publishers.append(pub)
    advertise(cluster, "d1", pub)
    store_until_indexed(cluster, pub, ids, lambda blocks: blocks == len(ids) // BLOCK_SIZE)  # every full block
    wait_for_fresh_polls(cluster)  # d1 back in every dispatcher's view since its publisher restarted

    headers, body = complete(cluster, prompt)
    assert (headers[c.H_ROUTE], headers[c.H_DECODE_NODE], headers[c.H_CACHED_TOKENS]) == (
        "deflect",
        "d1",
        str(cached),
    ), {k: v for k, v in headers.items() if k.startswith("x-kairos")}
    schedule = [int(x) for x in headers[c.H_CHUNK_SCHEDULE].split(",")]
    assert sum(schedule) == len(ids) - cached == body["usage"]["prompt_tokens"] - cached
    _, _, metrics = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}/metrics")
    assert f'kairos_dispatcher_prefix_hit_tokens_total{{role="decode",route="deflect"}} {float(cached)}' in (
        metrics.decode()
    )

    # The node's engine restarts on the same ports: its cache starts empty, its sequence over.
    # It caches another prompt; the first one (computed only on d1, whose real cache this test's
    # publisher stands for) is cached on no node the dispatcher indexes any more.
    pub.close()
    restarted = VllmEventPublisher(*(f"tcp://127.0.0.1:{port}" for port in pub.ports))
    publishers.append(restarted)
    second = f"another {text_of(tokenizer, 5990)}"
    second_ids = tokenizer.completion_prompt_ids(second)
    store_until_indexed(cluster, restarted, second_ids, lambda blocks: blocks == len(second_ids) // BLOCK_SIZE)
    headers, _ = complete(cluster, prompt)
    assert headers[c.H_ROUTE] == "keep" and c.H_CACHED_TOKENS not in headers

    # Gone for good (the engine dead, its heartbeat still beating): its hits are zero, and the
    # second prompt, never sent, is cached nowhere else.
    restarted.close()
    wait_until(
        lambda: (s := kv_state(cluster, "d1")) and not s["connected"] and s["cached_blocks"] == 0,
        what="d1's connection lost and its index cleared",
    )
    headers, _ = complete(cluster, second)
    assert headers[c.H_ROUTE] == "keep" and c.H_CACHED_TOKENS not in headers
