"""Faults through the real stack: Redis gone and back, a decode node dying, every prefill node
dying, two dispatcher replicas racing for one decode node, and the dispatcher itself gone."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.launcher.local_cluster import LocalCluster
from tests.e2e.conftest import http, post_json, start_cluster, text_of

MODEL = "kairos-tiny-llama"


def dispatcher_health(cluster: LocalCluster, index: int = 0) -> str:
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/health")
    return json.loads(body)["status"]


def dispatcher_nodes(cluster: LocalCluster, index: int = 0) -> list[str]:
    """Ids of the nodes in the dispatcher's view, from its /nodes report."""
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/nodes")
    return [n["id"] for n in json.loads(body)["nodes"]]


def redis_errors(cluster: LocalCluster, index: int = 0) -> float:
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/metrics")
    return sum(float(v) for v in re.findall(r"^kairos_dispatcher_redis_errors_total\{[^}]*\} (\S+)$",
                                            body.decode(), re.M))


def wait_until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def complete(cluster: LocalCluster, prompt: str, max_tokens: int = 2) -> tuple[int, dict[str, str]]:
    status, headers, body = post_json(f"{cluster.gateway_url}/v1/completions",
                                      {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                                      {"x-request-id": f"fault-{uuid.uuid4().hex[:10]}"})
    assert status == 200, body
    return status, headers


def load_prefill(cluster: LocalCluster, tokenizer: PromptTokenizer, n: int = 4) -> list[threading.Thread]:
    long_prompt = text_of(tokenizer, 16_000)
    threads = [threading.Thread(target=complete, args=(cluster, long_prompt, 1), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.4)
    return threads


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("faults"), model_dir)
    yield c
    c.stop()


def test_redis_down_keeps_serving_on_the_pd_path_and_deflection_resumes_after(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    assert cluster.redis is not None
    cluster.redis.stop()
    wait_until(lambda: dispatcher_health(cluster) == "degraded")
    assert redis_errors(cluster) > 0
    # Degraded: every request is still served, and never deflected on a stale view (on a
    # healthy idle cluster this short prompt deflects: see the test after the restart).
    short = text_of(tokenizer, 400)
    routes = [complete(cluster, short)[1]["x-kairos-route"] for _ in range(4)]
    assert routes == ["keep"] * 4

    cluster.start_redis()
    wait_until(lambda: dispatcher_health(cluster) == "ok")
    wait_until(lambda: cluster.nodes_unseen() == [])  # publishers beat again, the dispatcher sees them
    assert complete(cluster, short)[1]["x-kairos-route"] == "deflect"


def test_a_dead_decode_node_gets_no_request_once_its_heartbeat_expires(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    node = cluster.node("d1")
    assert node.engine is not None
    wait_until(lambda: cluster.nodes_unseen() == [])  # the dispatcher routes on all four, fresh
    node.engine.kill()
    wait_until(lambda: dispatcher_nodes(cluster) == ["d0", "p0", "p1"])  # its heartbeat key expired
    prompt = text_of(tokenizer, 400)
    used = Counter(complete(cluster, prompt)[1]["x-kairos-decode-node"] for _ in range(12))
    assert used == Counter({"d0": 12})


def test_with_every_prefill_node_dead_decode_nodes_prefill_requests_themselves(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    for node_id in ("p0", "p1"):
        engine = cluster.node(node_id).engine
        assert engine is not None
        engine.kill()
    # Stale, or gone once their keys expire: either way the dispatcher has no prefill node to use.
    wait_until(lambda: {"p0", "p1"} <= set(cluster.nodes_unseen()))
    prompt = text_of(tokenizer, 3000)
    seen = [complete(cluster, prompt, max_tokens=4)[1] for _ in range(6)]
    assert {(h["x-kairos-route"], h["x-kairos-reason"]) for h in seen} == {("deflect", "deflect_no_prefill_node")}
    assert {h["x-kairos-decode-node"] for h in seen} == {"d0"}  # d1 died in the test before


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("replicas"), model_dir, dispatchers=2)
    yield c
    c.stop()


def test_two_dispatchers_never_deflect_twice_onto_one_decode_node_within_a_heartbeat(
    replicas: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    threads = load_prefill(replicas, tokenizer)
    prompt = text_of(tokenizer, 1500)
    barrier = threading.Barrier(8)
    results: list[tuple[float, dict[str, str]]] = []

    def send() -> None:
        barrier.wait()
        sent = time.monotonic()
        _, headers = complete(replicas, prompt)
        results.append((sent, headers))

    burst = [threading.Thread(target=send) for _ in range(8)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(timeout=120)
    assert len(results) == 8
    sent_times = [s for s, _ in results]
    assert max(sent_times) - min(sent_times) < 0.1  # one burst, inside one heartbeat period
    deflected = Counter(h["x-kairos-decode-node"] for _, h in results if h["x-kairos-route"] == "deflect")
    assert deflected, "the burst should have deflected at least once"
    assert max(deflected.values()) == 1, deflected
    # Both replicas decided part of the burst (Envoy balances the ext_proc streams).
    decided = []
    for i in range(2):
        _, _, body = http("GET", f"http://127.0.0.1:{replicas.dispatcher_metrics_ports[i]}/metrics")
        decided.append(sum(float(v) for v in re.findall(r"^kairos_dispatcher_decisions_total\{[^}]*\} (\S+)$",
                                                        body.decode(), re.M)))
    assert all(d > 0 for d in decided), decided
    for t in threads:
        t.join(timeout=60)


def test_dispatcher_gone_gives_a_prompt_503_not_a_hang(replicas: LocalCluster) -> None:
    for proc in replicas.dispatcher_procs:
        proc.kill()
    started = time.monotonic()
    status, headers, raw = http("POST", f"{replicas.gateway_url}/v1/completions",
                                json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode(),
                                {"content-type": "application/json"}, timeout=10)
    assert status == 503
    assert time.monotonic() - started < 3.0
    assert headers["content-type"].startswith("application/json")
    assert json.loads(raw)["error"]["code"] == 503
