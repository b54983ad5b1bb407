"""Real vLLM on CPU: the split route's two hops, sent by hand as the sidecar sends them. The
prefill node computes the prompt's first k tokens; the decode node pulls their KV over NIXL (the
Kairos connector, :mod:`kairos.nodeagent.vllm_plugin.split_connector`) and prefills the other
l - k itself under the request's chunk schedule; greedy output is a keep's and a single node's.

Each reference runs under a cache salt of its own (vLLM's ``cache_salt``), so no request here
reads KV another one left in a node's prefix cache: each path computes or pulls the whole prompt.
"""

from __future__ import annotations

import re
import threading
import uuid
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.launcher.vllm_cluster import VllmCluster
from kairos.nodeagent.sidecar.hop1 import HOP1_KV_TRANSFER_PARAMS
from tests.e2e.conftest import post_json
from tests.integration.conftest import MODEL_NAME, get_json, metric, scrape
from tests.integration.test_vllm_node import completion, direct, token_prompt
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

SRC = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
MAX_TOKENS = 8


def block_size(cluster: VllmCluster, node_id: str) -> int:
    """The node's KV block size, from vLLM's ``cache_config_info``."""
    text = scrape(f"http://{cluster.node(node_id).url}/metrics")
    found = re.search(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text, re.MULTILINE)
    assert found, "vLLM's /metrics has no cache_config_info block_size"
    return int(found.group(1))


def counters(cluster: VllmCluster) -> dict[tuple[str, str], float]:
    """vLLM's prompt tokens by source on p0 and d0."""
    urls = {n: f"http://{cluster.node(n).url}/metrics" for n in ("p0", "d0")}
    return {(n, s): metric(url, SRC, source=s) for n, url in urls.items() for s in SOURCES}


def post(cluster: VllmCluster, node_id: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    url = f"http://{cluster.node(node_id).url}/v1/completions"
    status, _, out = post_json(url, body, {c.H_REQUEST_ID: request_id}, timeout=180)
    assert status == 200, out
    return out


def hop1(cluster: VllmCluster, prompt: list[int], salt: str, request_id: str) -> dict[str, Any]:
    """Hop 1 (keep or split) to p0: the sidecar's body, whose answer carries the KV's whereabouts."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "cache_salt": salt,
        c.KV_TRANSFER_PARAMS: dict(HOP1_KV_TRANSFER_PARAMS),
    }
    params = post(cluster, "p0", body, request_id)[c.KV_TRANSFER_PARAMS]
    assert params and params["remote_block_ids"], params
    return params


def chunks(cluster: VllmCluster, node_id: str, request_id: str) -> list[tuple[int, int]]:
    """(tokens, cached) of each prefill chunk the node's step recorder saw for the request."""
    steps = get_json(f"{cluster.steps_url(node_id)}?since=0")["steps"]
    return [(ch["tokens"], ch["cached"]) for s in steps for ch in s["chunks"] if request_id in ch["request_id"]]


def settled(cluster: VllmCluster, before: dict[tuple[str, str], float], want: dict[tuple[str, str], int]) -> dict:
    """The counters' change since ``before`` once each one in ``want`` has reached its figure
    (vLLM's stats may trail the answer by a step); every other source's change too."""
    wait_until(
        lambda: all(counters(cluster)[key] - before[key] >= n for key, n in want.items()), 60.0, f"counters {want}"
    )
    after = counters(cluster)
    return {key: after[key] - before[key] for key in before}


def test_split_prefills_k_tokens_on_p_and_the_rest_on_d_under_its_schedule(vllm_cluster: VllmCluster) -> None:
    cluster = vllm_cluster
    bs = block_size(cluster, "d0")
    assert block_size(cluster, "p0") == bs
    prompt = token_prompt(320, seed=34)
    k = max(bs, 128 // bs * bs)  # a multiple of the block, as the dispatcher plans it
    tail = len(prompt) - k
    assert 0 < k < len(prompt) and tail > 2
    schedule = [tail // 2, tail // 4, tail - tail // 2 - tail // 4]  # sums to l - k, sizes of their own
    tag = uuid.uuid4().hex[:8]
    salt, rid1, rid2 = f"split-{tag}", f"split-hop1-{tag}", f"split-hop2-{tag}"

    before = counters(cluster)
    params = hop1(cluster, prompt[:k], salt, rid1)
    assert params["remote_num_tokens"] == k
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    body = completion(prompt, MAX_TOKENS, cache_salt=salt, return_token_ids=True)
    body |= {c.KV_TRANSFER_PARAMS: params, c.VLLM_XARGS: c.schedule_xargs(schedule)}
    split = post(cluster, "d0", body, rid2)

    delta = settled(cluster, before, {("p0", "local_compute"): k, ("d0", "external_kv_transfer"): k})
    assert split["usage"]["prompt_tokens"] == len(prompt)
    # p0 computed the prefix alone; d0 pulled exactly it and computed exactly the rest.
    assert delta == {
        ("p0", "local_compute"): k,
        ("p0", "local_cache_hit"): 0,
        ("p0", "external_kv_transfer"): 0,
        ("d0", "local_compute"): tail,
        ("d0", "local_cache_hit"): 0,
        ("d0", "external_kv_transfer"): k,
    }
    assert chunks(cluster, "p0", rid1) == [(k, 0)]
    # d0's chunks: the schedule's sizes, from the pulled prefix on (vLLM's num_computed_tokens = k).
    assert chunks(cluster, "d0", rid2) == [(n, k + sum(schedule[:i])) for i, n in enumerate(schedule)]

    # A keep of the same prompt (hop 1 with all of it, hop 2 with its params), and d0 alone.
    keep_salt = f"keep-{tag}"
    keep_params = hop1(cluster, prompt, keep_salt, f"keep-hop1-{tag}")
    assert keep_params["remote_num_tokens"] == len(prompt)
    keep_body = completion(prompt, MAX_TOKENS, cache_salt=keep_salt, return_token_ids=True)
    keep = post(cluster, "d0", keep_body | {c.KV_TRANSFER_PARAMS: keep_params}, f"keep-hop2-{tag}")
    alone = direct(cluster, "d0", completion(prompt, MAX_TOKENS, cache_salt=f"alone-{tag}", return_token_ids=True))

    ids = [out["choices"][0]["token_ids"] for out in (split, keep, alone)]
    assert ids[0] and len(ids[0]) == MAX_TOKENS
    assert ids[0] == ids[1] == ids[2]
    assert split["choices"][0]["text"] == keep["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_keep_still_pulls_the_whole_prompt(vllm_cluster: VllmCluster) -> None:
    """The connector changes nothing for a keep: hop 1 computed the whole prompt, d0 pulls all of
    it (its last token recomputed, as vLLM does) and prefills nothing itself."""
    cluster = vllm_cluster
    prompt = token_prompt(300, seed=35)
    tag = uuid.uuid4().hex[:8]
    salt = f"keep-{tag}"
    before = counters(cluster)
    params = hop1(cluster, prompt, salt, f"keep-hop1-{tag}")
    rid = f"keep-hop2-{tag}"
    post(cluster, "d0", completion(prompt, 2, cache_salt=salt) | {c.KV_TRANSFER_PARAMS: params}, rid)

    delta = settled(cluster, before, {("p0", "local_compute"): 300, ("d0", "external_kv_transfer"): 300})
    assert (delta[("p0", "local_compute")], delta[("d0", "external_kv_transfer")]) == (300, 300)
    assert delta[("d0", "local_compute")] == 0
    assert chunks(cluster, "d0", rid) == [(1, 299)]  # the prompt's last token, to sample from


def test_a_splits_pull_overlaps_the_scheduled_prefill_in_progress(vllm_cluster: VllmCluster) -> None:
    """One scheduled prefill advances at a time, but a split's pull computes nothing: it starts
    while a deflection's long schedule runs, so its tail is ready when that ends and runs in the
    very next step (a pull started only then would take steps of its own first)."""
    cluster = vllm_cluster
    bs = block_size(cluster, "d0")
    tag = uuid.uuid4().hex[:8]
    long_prompt = token_prompt(3000, seed=36)  # a deflection of 750 steps of 4 tokens: seconds on any host
    prompt = token_prompt(320, seed=37)
    k = max(bs, 128 // bs * bs)
    salt, deflected, rid = f"overlap-{tag}", f"overlap-deflect-{tag}", f"overlap-split-{tag}"
    params = hop1(cluster, prompt[:k], salt, f"overlap-hop1-{tag}")
    deflection = completion(long_prompt, 4, cache_salt=salt) | {c.VLLM_XARGS: c.schedule_xargs([4])}
    runner = threading.Thread(target=post, args=(cluster, "d0", deflection, deflected))
    runner.start()
    try:
        wait_until(lambda: len(chunks(cluster, "d0", deflected)) >= 10, 120.0, "the deflection's first chunks")
        body = completion(prompt, 2, cache_salt=salt) | {c.KV_TRANSFER_PARAMS: params}
        post(cluster, "d0", body | {c.VLLM_XARGS: c.schedule_xargs([len(prompt) - k])}, rid)
    finally:
        runner.join(timeout=300)

    steps = get_json(f"{cluster.steps_url('d0')}?since=0")["steps"]

    def indices(request_id: str) -> list[int]:
        return [s["index"] for s in steps for ch in s["chunks"] if request_id in ch["request_id"]]

    deflect_steps, split_steps = indices(deflected), indices(rid)
    assert len(deflect_steps) == len(long_prompt) // 4
    assert chunks(cluster, "d0", rid) == [(len(prompt) - k, k)]  # pulled k, then the tail in one chunk
    assert split_steps == [deflect_steps[-1] + 1], (deflect_steps[-3:], split_steps)
