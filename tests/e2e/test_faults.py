"""Faults through the real stack: Redis gone and back, a decode node dying, every prefill node
dying, two dispatcher replicas racing for one decode node, and the dispatcher itself gone.

No test depends on another: each destructive test either starts from :func:`whole_and_idle`,
which puts back what an earlier (or a failed) test took down and waits until every dispatcher
routes on exactly the whole, idle cluster, or has a cluster of its own (the dispatchers killed
for good)."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import redis as redis_sync
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster
from kairos.launcher.processes import tcp_ready
from tests.e2e.conftest import (
    decisions,
    heartbeat_of,
    http,
    load_prefill_queues,
    post_json,
    start_cluster,
    steps_of,
    text_of,
    wait_for_fresh_polls,
)
from tests.waiting import wait_until

MODEL = "kairos-tiny-llama"


def dispatcher_health(cluster: LocalCluster, index: int = 0) -> str:
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/health")
    return json.loads(body)["status"]


def dispatcher_nodes(cluster: LocalCluster, index: int = 0) -> list[str]:
    """Ids of the nodes in the dispatcher's view, from its /nodes report."""
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/nodes")
    return [n["id"] for n in json.loads(body)["nodes"]]


def fresh_nodes(cluster: LocalCluster, index: int = 0) -> list[str]:
    """Ids of the nodes in the dispatcher's view with a fresh heartbeat (not stale)."""
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/nodes")
    return sorted(n["id"] for n in json.loads(body)["nodes"] if not n["stale"])


def redis_errors(cluster: LocalCluster, index: int = 0) -> float:
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/metrics")
    return sum(float(v) for v in re.findall(r"^kairos_dispatcher_redis_errors_total\{[^}]*\} (\S+)$",
                                            body.decode(), re.M))


def complete(cluster: LocalCluster, prompt: str, max_tokens: int = 2,
             request_id: str | None = None) -> tuple[int, dict[str, str]]:
    status, headers, body = post_json(f"{cluster.gateway_url}/v1/completions",
                                      {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                                      {"x-request-id": request_id or f"fault-{uuid.uuid4().hex[:10]}"})
    assert status == 200, body
    return status, headers


def _reservations(cluster: LocalCluster) -> list[bytes]:
    client = redis_sync.Redis.from_url(cluster.redis_url, socket_timeout=10)
    try:
        return list(client.scan_iter(c.REDIS_RESERVATION_KEY.format(node_id="*")))
    finally:
        client.close()


def _idle(beat: dict[str, object] | None) -> bool:
    return (
        beat is not None
        and not beat[c.HeartbeatField.QUEUED_PREFILL_TOKENS]
        and not beat[c.HeartbeatField.SCHEDULED_PREFILL_TOKENS]
        and beat[c.HeartbeatField.DECODE_TOKENS] == 0
    )


def whole_and_idle(cluster: LocalCluster) -> None:
    """The state every test on a shared cluster starts from, whatever ran (or failed) before it:
    Redis up, every node's engine up (a killed one restarted on its port; its publisher and
    sidecar never stopped), every dispatcher healthy with exactly the cluster's nodes in its view,
    all fresh, every node idle, no deflection reservation left, and every dispatcher has polled
    since, so the first request is decided on that view."""
    assert all(d.alive() for d in cluster.dispatcher_procs), "a dispatcher died; no test here kills a shared one"
    if cluster.redis is None or not cluster.redis.alive():
        cluster.start_redis()
    for node in cluster.nodes:
        if node.engine is None or not node.engine.alive():
            node.engine = cluster.group.start(cluster.engine_process(node), 60.0)
        assert node.publisher is not None and node.publisher.alive(), node.node_id
        assert node.sidecar is None or node.sidecar.alive(), node.node_id
    everyone = sorted(n.node_id for n in cluster.nodes)
    for index in range(len(cluster.dispatcher_procs)):
        wait_until(lambda i=index: dispatcher_health(cluster, i) == "ok", what=f"dispatcher {index} healthy")
        wait_until(lambda i=index: fresh_nodes(cluster, i) == everyone == sorted(dispatcher_nodes(cluster, i)),
                   what=f"dispatcher {index} routing on exactly {everyone}, all fresh")
    wait_until(lambda: all(_idle(heartbeat_of(cluster, n)) for n in everyone), what="every node idle")
    wait_until(lambda: not _reservations(cluster), what="no deflection reservation left")
    wait_for_fresh_polls(cluster)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("faults"), model_dir)
    yield c
    c.stop()


@pytest.fixture
def whole(cluster: LocalCluster) -> LocalCluster:
    """The shared 2P2D cluster, whole and idle (:func:`whole_and_idle`) as this test starts."""
    whole_and_idle(cluster)
    return cluster


def test_redis_down_keeps_serving_on_the_pd_path_and_deflection_resumes_after(
    whole: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    cluster = whole
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
    whole: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    cluster = whole
    node = cluster.node("d1")
    assert node.engine is not None
    node.engine.kill()
    wait_until(lambda: dispatcher_nodes(cluster) == ["d0", "p0", "p1"])  # its heartbeat key expired
    prompt = text_of(tokenizer, 400)
    used = Counter(complete(cluster, prompt)[1]["x-kairos-decode-node"] for _ in range(12))
    assert used == Counter({"d0": 12})


def test_with_every_prefill_node_dead_decode_nodes_prefill_requests_themselves(
    whole: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    cluster = whole
    for node_id in ("p0", "p1"):
        engine = cluster.node(node_id).engine
        assert engine is not None
        engine.kill()
    # Stale, or gone once their keys expire: either way the dispatcher has no prefill node to use.
    wait_until(lambda: {"p0", "p1"} <= set(cluster.nodes_unseen()))
    prompt = text_of(tokenizer, 3000)
    tokens = tokenizer.count_completion_prompt(prompt)
    ids = [f"noprefill-{i}-{uuid.uuid4().hex[:8]}" for i in range(6)]
    seen = {rid: complete(cluster, prompt, max_tokens=4, request_id=rid)[1] for rid in ids}
    assert {(h["x-kairos-route"], h["x-kairos-reason"]) for h in seen.values()} == {
        ("deflect", "deflect_no_prefill_node")
    }
    for rid, h in seen.items():  # the decode node it went to computed the whole prompt itself
        assert h["x-kairos-decode-node"] in ("d0", "d1"), h
        assert sum(steps_of(cluster, h["x-kairos-decode-node"], rid)) == tokens, (rid, h)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("replicas"), model_dir, dispatchers=2)
    yield c
    c.stop()


def test_two_dispatchers_never_deflect_twice_onto_one_decode_node_within_a_heartbeat(
    replicas: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    """Judged on when each replica decided (its DEBUG decision line), not on when the client sent:
    a starved host may spread the sends of one burst, and decisions further apart than a heartbeat
    may rightly pick the same node again. A burst in which no two replicas decided within one
    heartbeat raced nothing and proves nothing, so it is sent again (at most three bursts)."""
    whole_and_idle(replicas)
    period = c.HEARTBEAT_PERIOD_S
    prompt = text_of(tokenizer, 1500)
    for attempt in range(1, 4):
        threads = load_prefill_queues(replicas, tokenizer)
        ids = [f"burst{attempt}-{i}-{uuid.uuid4().hex[:8]}" for i in range(8)]
        barrier = threading.Barrier(len(ids))
        routes: dict[str, dict[str, str]] = {}

        def send(request_id: str, barrier: threading.Barrier, routes: dict[str, dict[str, str]]) -> None:
            barrier.wait()
            routes[request_id] = complete(replicas, prompt, request_id=request_id)[1]

        burst = [threading.Thread(target=send, args=(rid, barrier, routes)) for rid in ids]
        for t in burst:
            t.start()
        for t in burst:
            t.join(timeout=120)
        assert len(routes) == len(ids)
        decided = decisions(replicas, ids)
        for rid, (_, _, route, node) in decided.items():  # the logs say what the client saw
            assert (route, node) == (routes[rid]["x-kairos-route"], routes[rid]["x-kairos-decode-node"]), rid
        deflections = sorted((node, at) for at, _, route, node in decided.values() if route == "deflect")
        for (node_a, at_a), (node_b, at_b) in itertools.pairwise(deflections):
            assert node_a != node_b or at_b - at_a >= period, f"{node_a} deflected onto twice: {deflections}"
        for t in threads:
            t.join(timeout=120)
        times = sorted((at, index) for at, index, _, _ in decided.values())
        raced = any(b - a < period and ia != ib for (a, ia), (b, ib) in itertools.pairwise(times))
        if raced:
            break
        wait_until(lambda: not _reservations(replicas), what="the last burst's reservations expired")
    else:
        pytest.fail(f"in 3 bursts of 8 no two replicas decided within {period} s of each other: {times}")
    assert deflections, f"the burst should have deflected at least once: {decided}"


@pytest.fixture
def doomed(tmp_path: Path, model_dir: Path) -> Iterator[LocalCluster]:
    """A small cluster of this test's own (1P1D, two dispatcher replicas): it kills every dispatcher."""
    c = start_cluster(tmp_path / "doomed", model_dir, prefill_nodes=1, decode_nodes=1, dispatchers=2)
    yield c
    c.stop()


def test_dispatcher_gone_gives_a_prompt_503_not_a_hang(doomed: LocalCluster, tokenizer: PromptTokenizer) -> None:
    cluster = doomed
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
    json_type = {"content-type": "application/json"}
    # Served before: Envoy's path to the dispatchers is set up, so what follows is the fault alone.
    status, _, raw = http("POST", f"{cluster.gateway_url}/v1/completions", body, json_type)
    assert status == 200, raw
    for proc in cluster.dispatcher_procs:
        proc.kill()
    # Nothing but Envoy's answer in the measured window: every dispatcher port already refuses.
    for port in cluster.dispatcher_ports:
        wait_until(lambda p=port: not tcp_ready("127.0.0.1", p)(), what=f"dispatcher port {port} closed")
    started = time.monotonic()
    status, headers, raw = http("POST", f"{cluster.gateway_url}/v1/completions", body, json_type, timeout=10)
    elapsed = time.monotonic() - started
    assert status == 503, raw
    assert elapsed < 3.0, f"503 after {elapsed:.2f} s"
    assert headers["content-type"].startswith("application/json")
    error = json.loads(raw)["error"]  # Envoy's own reply, in the OpenAI shape: a code string, a message
    assert error["code"] == "no_healthy_node" and error["message"], error
