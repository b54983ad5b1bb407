"""A whole cluster on a TLS-only Redis with ACL users (``kairos up --redis-tls``): every part
talks ``rediss://`` with its own credential, a forged heartbeat written with the wrong
credential is refused by Redis, and one written under a key/content mismatch with a node's own
credential is ignored by the dispatchers and counted (issue 11, part 3)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

import redis
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster
from tests.builders import heartbeat_json
from tests.e2e.conftest import http, post_json, start_cluster, text_of
from tests.waiting import wait_until

MODEL = "kairos-tiny-llama"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("tls-cluster"), model_dir, redis_tls=True)
    yield c
    c.stop()


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)


def metric(cluster: LocalCluster, name: str, labels: str, index: int = 0) -> float:
    _, _, body = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[index]}/metrics")
    match = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", body.decode(), re.M)
    return float(match.group(1)) if match else 0.0


def rejected(cluster: LocalCluster, reason: str) -> float:
    return metric(cluster, "kairos_dispatcher_heartbeats_rejected_total", f'reason="{reason}"')


def test_every_part_talks_rediss_with_its_own_user_and_no_secret_is_on_a_command_line(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    setup = cluster.redis_setup
    assert setup is not None and setup.tls and cluster.redis_url.startswith("rediss://kairos-admin:")
    body = {"model": MODEL, "prompt": text_of(tokenizer, 6000), "max_tokens": 4, "stream": True}
    status, _, raw = http(
        "POST", f"{cluster.gateway_url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    # the sidecar's TTFT sample (a stream's: its first token) went over TLS with the decode node's
    # user; the dispatcher read it
    wait_until(
        lambda: metric(cluster, "kairos_dispatcher_ttft_observed_over_predicted_count", 'path="keep"') >= 1,
        what="the dispatcher reading the sidecar's TTFT sample",
    )
    procs = [p for p in cluster.group.procs if p.proc is not None]
    argv = " ".join(" ".join(p.argv) for p in procs)
    assert all(password not in argv for password in setup.passwords.values())
    assert "--redis" not in argv


def test_redis_refuses_a_client_without_the_credential_or_without_tls(cluster: LocalCluster) -> None:
    setup = cluster.redis_setup
    assert setup is not None
    assert client(cluster.redis_url).ping()
    with pytest.raises(AuthenticationError):
        client(f"rediss://127.0.0.1:{setup.port}/0?ssl_ca_certs={setup.ca_path}").ping()
    with pytest.raises(ConnectionError):
        client(f"redis://127.0.0.1:{setup.port}/0").ping()


def test_a_forged_heartbeat_written_with_a_wrong_credential_is_refused(cluster: LocalCluster) -> None:
    setup = cluster.redis_setup
    assert setup is not None
    d0 = cluster.node("d0")
    forged = heartbeat_json("d0", 10**9, role="decode", url="127.0.0.1:9", sidecar="127.0.0.1:9")
    p0 = client(setup.node_url("p0"))
    for key in (c.REDIS_NODE_KEY.format(node_id="d0"), c.REDIS_NODE_KEY.format(node_id="evil")):
        with pytest.raises(NoPermissionError):
            p0.set(key, forged, px=500)
    with pytest.raises(NoPermissionError):
        p0.set(c.REDIS_RESERVATION_KEY.format(node_id="d0"), "p0")
    with pytest.raises(AuthenticationError):
        client(f"rediss://kairos-node-d0:guess@127.0.0.1:{setup.port}/0?ssl_ca_certs={setup.ca_path}").set(
            c.REDIS_NODE_KEY.format(node_id="d0"), forged
        )
    # The key can lapse for a moment between beats on a starved host: wait for a beat, then judge it.
    reader = client(cluster.redis_url)
    raw = wait_until(lambda: reader.get(c.REDIS_NODE_KEY.format(node_id="d0")), what="a heartbeat of d0")
    beat = json.loads(raw)
    assert (beat.get("url"), beat.get("sidecar")) == (d0.url, d0.sidecar_url)


def test_a_heartbeat_under_a_key_content_mismatch_is_ignored_and_counted(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    """p0's own credential writes p0's key, but with another address, or claiming to be d0: the
    dispatchers ignore every such value (requests keep working) and count it."""
    setup = cluster.redis_setup
    assert setup is not None
    p0 = client(setup.node_url("p0"))
    key = c.REDIS_NODE_KEY.format(node_id="p0")
    before = {r: rejected(cluster, r) for r in ("address_mismatch", "key_mismatch")}
    stop = threading.Event()
    written = {"address_mismatch": 0, "key_mismatch": 0}

    def forge() -> None:  # faster than p0's own publisher, so the dispatchers read forgeries
        seq = 10**9
        while not stop.is_set():
            seq += 1
            p0.set(key, heartbeat_json("p0", seq, url="127.0.0.1:9"), px=500)
            written["address_mismatch"] += 1
            stop.wait(0.005)
            p0.set(key, heartbeat_json("d0", seq, role="decode", url="127.0.0.1:9", sidecar="127.0.0.1:9"), px=500)
            written["key_mismatch"] += 1
            stop.wait(0.005)

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        wait_until(
            lambda: all(rejected(cluster, r) > before[r] for r in before),
            what="the dispatcher counting both kinds of forged heartbeat",
        )
        for _ in range(5):
            # Kept (a prompt of its own each: a repeated one would be found cached on a decode
            # node): its prefill runs on p0 or p1, never at a forged address.
            prompt = text_of(tokenizer, 6000)
            status, headers, body = post_json(
                f"{cluster.gateway_url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            )
            assert status == 200, body
            assert headers["x-kairos-route"] == "keep"
    finally:
        stop.set()
        forger.join()
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}/nodes")
    report = json.loads(raw)
    assert report["rejected_heartbeats"]["address_mismatch"] > 0 and report["rejected_heartbeats"]["key_mismatch"] > 0
    assert written["address_mismatch"] > 0 and written["key_mismatch"] > 0
    # p0 may have left the view (no valid beat for a while under the flood); its publisher brings it back
    wait_until(lambda: not cluster.nodes_unseen(), what="every node back in the dispatchers' view")
