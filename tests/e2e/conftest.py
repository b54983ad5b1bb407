"""Shared pieces of the end-to-end tests: a real local cluster (redis-server, Envoy, the
dispatcher, sidecars, publishers and emulated vLLM nodes, each its own process)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.tinymodel import build_tiny_model

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly".split()  # noqa: SIM905


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "e2e-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


def text_of(tokenizer: PromptTokenizer, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (BOS included; tests take exact counts from the tokenizer)."""
    words: list[str] = []
    i = 0
    while tokenizer.count_completion_prompt(" ".join(words)) < tokens:
        step = max(1, (tokens - tokenizer.count_completion_prompt(" ".join(words))) // 2)
        words.extend(WORDS[(i + j) % len(WORDS)] for j in range(step))
        i += step
    while tokenizer.count_completion_prompt(" ".join(words)) > tokens:
        words.pop()
    text = " ".join(words)
    assert tokens - 10 <= tokenizer.count_completion_prompt(text) <= tokens
    return text


def start_cluster(workdir: Path, model_dir: Path, **overrides: Any) -> LocalCluster:
    config = LocalClusterConfig(gateway_port=0, model_dir=str(model_dir), log_level="DEBUG", **overrides)
    cluster = LocalCluster(config, workdir)
    cluster.start()
    cluster.wait_for_heartbeats()
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), model_dir)
    yield c
    c.stop()


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def post_json(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
              timeout: float = 60.0) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, hdrs, raw = http("POST", url, json.dumps(payload).encode(),
                             {"content-type": "application/json", **(headers or {})}, timeout)
    return status, hdrs, json.loads(raw)


def steps_of(cluster: LocalCluster, node_id: str, request_id: str) -> list[int]:
    """Prompt tokens per step that ``node_id`` ran for ``request_id``, from its step log."""
    _, _, raw = http("GET", f"http://{cluster.node(node_id).url}/kairos/steps?since=0")
    return [c["tokens"] for s in json.loads(raw)["steps"] for c in s["chunks"] if c["request_id"] == request_id]
