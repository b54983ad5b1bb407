"""Shared pieces of the end-to-end tests: a real local cluster (redis-server, Envoy, the
dispatcher, sidecars, publishers and emulated vLLM nodes, each its own process)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import redis as redis_sync
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster, cluster_config
from kairos.launcher.tinymodel import build_tiny_model
from tests.waiting import wait_until

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly".split()  # noqa: SIM905


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "e2e-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


_PROMPTS = itertools.count()


def text_of(tokenizer: PromptTokenizer, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (BOS included; tests take exact counts from the tokenizer).
    Each call's prompt opens with a word of its own: the nodes cache prefixes (as vLLM does), so two
    prompts sharing their first block would find each other's KV cached, and a test would see its
    request routed and computed as the one before it left the cluster."""
    words: list[str] = [f"s{next(_PROMPTS)}"]
    i = 0
    while tokenizer.count_completion_prompt(" ".join(words)) < tokens:
        step = max(1, (tokens - tokenizer.count_completion_prompt(" ".join(words))) // 2)
        words.extend(WORDS[(i + j) % len(WORDS)] for j in range(step))
        i += step
    while len(words) > 1 and tokenizer.count_completion_prompt(" ".join(words)) > tokens:
        words.pop()
    text = " ".join(words)
    assert tokens - 10 <= tokenizer.count_completion_prompt(text) <= tokens
    return text


# The paper's Eq. 7 (alpha 1.3, no deflection gate) unless a test says otherwise: these tests
# exercise the deflection path on an idle cluster, where the default gate keeps every request
# (its keep path meets the TTFT SLO with room; tests/unit/test_algorithm.py decides that part).
EQ7 = {"alpha": 1.3, "policy": "kairos", "deflect_gate_share": None}


def start_cluster(workdir: Path, model_dir: Path, **overrides: Any) -> LocalCluster:
    settings = {**EQ7, **overrides}
    config = cluster_config(gateway_port=0, model_dir=str(model_dir), log_level="DEBUG", **settings)
    cluster = LocalCluster(config, workdir)
    cluster.start()
    cluster.wait_for_heartbeats(timeout_s=60.0)  # generous: a starved host starts a dozen processes slowly
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), model_dir)
    yield c
    c.stop()


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def post_json(
    url: str, payload: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, hdrs, raw = http(
        "POST", url, json.dumps(payload).encode(), {"content-type": "application/json", **(headers or {})}, timeout
    )
    return status, hdrs, json.loads(raw)


def steps_of(cluster: LocalCluster, node_id: str, request_id: str) -> list[int]:
    """Prompt tokens per step that ``node_id`` ran for ``request_id``, from its step log."""
    _, _, raw = http("GET", f"http://{cluster.node(node_id).url}/kairos/steps?since=0")
    return [c["tokens"] for s in json.loads(raw)["steps"] for c in s["chunks"] if c["request_id"] == request_id]


# ---------------------------------------------------------------------------------------------
# What the dispatchers see: positive signals to wait on instead of sleeping
# ---------------------------------------------------------------------------------------------
def _node_ages(cluster: LocalCluster, index: int) -> dict[str, float]:
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/nodes", timeout=10)
    return {n["id"]: n["age_s"] for n in json.loads(raw)["nodes"]}


def wait_for_fresh_polls(cluster: LocalCluster, polls: int = 1, timeout_s: float = 30.0) -> None:
    """Until every dispatcher has taken ``polls`` newer heartbeats of some node into its view
    after this call, so that it has read Redis as it is now (or later).

    A node's ``age_s`` in ``/nodes`` only falls when a poll finds a newer beat of it, and such a
    poll, seen after the first sample, came after that sample. Sampling slower than the beats may
    miss one (then this waits for the next); it never counts one that did not happen."""
    for index in range(len(cluster.dispatcher_metrics_ports)):
        wait_until(
            _fresh_polls_counter(cluster, index, polls),
            timeout_s,
            what=f"dispatcher {index} taking {polls} newer heartbeats",
        )


def _fresh_polls_counter(cluster: LocalCluster, index: int, polls: int) -> Callable[[], bool]:
    last = _node_ages(cluster, index)
    fresh: Counter[str] = Counter()

    def polled() -> bool:
        nonlocal last
        ages = _node_ages(cluster, index)
        fresh.update(node for node, age in ages.items() if node in last and age < last[node])
        last = ages
        return max(fresh.values(), default=0) >= polls

    return polled


def heartbeat_of(cluster: LocalCluster, node_id: str) -> dict[str, Any] | None:
    """The node's heartbeat as Redis holds it now (None: no key, the node is gone or not yet up)."""
    client = redis_sync.Redis.from_url(cluster.redis_url, socket_timeout=10)
    try:
        raw = client.get(c.REDIS_NODE_KEY.format(node_id=node_id))
    finally:
        client.close()
    return json.loads(raw) if raw else None


def load_prefill_queues(
    cluster: LocalCluster, tokenizer: PromptTokenizer, n: int = 4, min_tokens: int = 4096
) -> list[threading.Thread]:
    """Keep every prefill node busy for seconds with long prompts (too long to deflect); returns
    once each one's heartbeat shows at least ``min_tokens`` queued and every dispatcher has
    polled since, so the next request is decided on a saturated prefill pool."""
    long_prompt = text_of(tokenizer, 16_000)

    def send() -> None:
        post_json(
            f"{cluster.gateway_url}/v1/completions",
            {"model": "kairos-tiny-llama", "prompt": long_prompt, "max_tokens": 1},
            timeout=120,
        )

    threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # pacing only: the loaders arrive one by one, as separate clients would
    prefill = [node.node_id for node in cluster.nodes if node.role == "prefill"]

    def loaded() -> bool:
        beats = [heartbeat_of(cluster, node_id) for node_id in prefill]
        return all(b is not None and sum(b[c.HeartbeatField.QUEUED_PREFILL_TOKENS]) >= min_tokens for b in beats)

    wait_until(loaded, what=f"every prefill node's heartbeat showing >= {min_tokens} queued tokens")
    wait_for_fresh_polls(cluster)
    return threads


def decisions(cluster: LocalCluster, request_ids: list[str]) -> dict[str, tuple[float, int, str, str]]:
    """``request id -> (wall time, dispatcher index, route, decode node)`` of each request's routing
    decision, from the dispatchers' DEBUG decision lines (waits until every one is written)."""
    found: dict[str, tuple[float, int, str, str]] = {}
    wanted = set(request_ids)

    def read() -> bool:
        for index in range(len(cluster.dispatcher_procs)):
            log = cluster.workdir / "logs" / f"dispatcher{index}.log"
            for line in log.read_text(errors="replace").splitlines():
                # 2026-01-01 12:00:00,123 DEBUG kairos.extproc.dispatcher: request ID: deflect (...) decode=d0 ...
                parts = line.split()
                if len(parts) < 7 or parts[3] != "kairos.extproc.dispatcher:" or parts[4] != "request":
                    continue
                rid = parts[5].rstrip(":")
                if rid in wanted:
                    at = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    node = next((p.removeprefix("decode=") for p in parts if p.startswith("decode=")), "")
                    found[rid] = (at, index, parts[6], node)
        return wanted <= set(found)

    wait_until(read, what="every request's decision line in the dispatcher logs")
    return found
