"""Real vLLM on CPU with prefix caching on (vLLM's default): what a node publishes of its cache is
what Kairos computes, the hit Kairos predicts from those events is the hit vLLM reports, a
deflected prefill's chunk schedule runs over exactly the uncached tokens (and, when the hit
differs from the plan, by the rule the scheduler's docstring states), and a keep request whose
prefix the decode node already holds pulls only the blocks it lacks.

The prediction is Kairos's own path: the dispatcher's :class:`~kairos.extproc.kv_events.KvEventConsumer`
(a :class:`NodeEventSubscriber` per node into one :class:`PrefixIndex`) subscribed to the nodes'
ZMQ events, and :func:`prompt_prefix_hits` over the prompt's token ids.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import zmq

from kairos.common import contracts as c
from kairos.common.block_hash import block_keys
from kairos.common.kv_events import (
    BlockStored,
    block_key,
    decode_batch,
    decode_replay_reply,
    encode_replay_request,
)
from kairos.extproc.kv_events import KvEventConsumer
from kairos.launcher.vllm_cluster import VllmCluster
from tests.e2e.conftest import post_json
from tests.integration.conftest import get_json, metric
from tests.integration.test_vllm_node import completion, deflect_headers, direct, sidecar_url, token_prompt
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

T = TypeVar("T")
SRC = "vllm:prompt_tokens_by_source_total"


class EventWatch:
    """The dispatcher's KV event consumer, on an event loop thread of its own (the tests block)."""

    def __init__(self, cluster: VllmCluster, node_ids: Sequence[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-events-watch", daemon=True)
        self._thread.start()
        self.consumer: KvEventConsumer = self.call(KvEventConsumer)
        endpoints = {n: cluster.kv_event_endpoints(cluster.node(n)) for n in node_ids}
        assert all(endpoints.values()), endpoints
        asyncio.run_coroutine_threadsafe(self.consumer.set_nodes(endpoints), self.loop).result(30)
        for n in node_ids:  # connected, and the replay from 0 it asks for on connecting answered
            wait_until(lambda n=n: self.call(lambda: self._in_step(n)), timeout_s=30.0, what=f"{n}'s events in step")

    def _in_step(self, node_id: str) -> bool:
        sub = self.consumer.subscribers[node_id]
        return sub.connected and sub.replays_asked > 0 and sub.sync.replaying is None

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop's thread, where the index is changed."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def hits(self, token_ids: Sequence[int]) -> dict[str, int]:
        return self.call(lambda: self.consumer.hits(token_ids))

    def block_size(self) -> int:
        (size,) = self.call(self.consumer.index.block_sizes)
        return size

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.consumer.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def events(vllm_cluster: VllmCluster) -> Iterator[EventWatch]:
    watch = EventWatch(vllm_cluster, ("p0", "d0"))
    yield watch
    watch.close()


def returned_ids(out: dict[str, Any]) -> list[int]:
    ids = out["choices"][0]["token_ids"]
    assert isinstance(ids, list) and ids, out["choices"][0]
    return ids


def cached_tokens(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def held_by_node(computed_tokens: int, block_size: int) -> int:
    """What a node caches of a request that computed this many tokens' KV: its full blocks."""
    return computed_tokens // block_size * block_size


def turn_one(cluster: VllmCluster, events: EventWatch, node_id: str, prompt: list[int], answer: int) -> list[int]:
    """Serve a conversation's first turn on ``node_id``; the next turn's prompt prefix (the
    prompt and the answer), once the node's events show it cached."""
    out = direct(cluster, node_id, completion(prompt, answer, return_token_ids=True, ignore_eos=True))
    history = prompt + returned_ids(out)
    # vLLM computes the KV of every token but the last one sampled: those are its cached blocks.
    held = held_by_node(len(history) - 1, events.block_size())
    wait_until(lambda: events.hits([*history, 5])[node_id] >= held, timeout_s=30.0, what=f"turn 1 cached on {node_id}")
    return history


def expected_chunks(sizes: Sequence[int], uncached: int) -> list[int]:
    """The plugin's rule: the i-th size caps the i-th step vLLM computes, the last size
    repeating, until the uncached tokens are done."""
    out: list[int] = []
    while uncached > 0:
        out.append(min(sizes[min(len(out), len(sizes) - 1)], uncached))
        uncached -= out[-1]
    return out


def deflect(cluster: VllmCluster, prompt: list[int], sizes: list[int]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """A deflection onto d0 through its sidecar; the response and d0's (tokens, cached) per step
    for it, from the step recorder."""
    headers = deflect_headers(cluster, sizes)
    status, resp_headers, out = post_json(sidecar_url(cluster), completion(prompt, 4), headers, timeout=120)
    assert status == 200, out
    assert resp_headers[c.H_ROUTE] == "deflect"
    steps = get_json(f"{cluster.steps_url('d0')}?since=0")["steps"]
    rid = headers[c.H_REQUEST_ID]
    return out, [(ch["tokens"], ch["cached"]) for s in steps for ch in s["chunks"] if rid in ch["request_id"]]


# -- what a node publishes is what Kairos computes ------------------------------------------------
def test_published_block_keys_are_kairos_block_keys_and_replay_rebuilds_them(vllm_cluster: VllmCluster) -> None:
    """A prompt cached on d0 before anyone subscribes: a fresh consumer learns its blocks from
    vLLM's replay alone, and the BlockStored events vLLM replays carry exactly the keys (and
    tokens) :func:`kairos.common.block_hash.block_keys` computes for the prompt."""
    cluster = vllm_cluster
    prompt = token_prompt(3 * 128 + 40, seed=1001)
    direct(cluster, "d0", completion(prompt, 1))

    watch = EventWatch(cluster, ("d0",))  # subscribes now: what it knows came by replay
    try:
        bs = watch.block_size()
        full = held_by_node(len(prompt), bs)
        keys = block_keys(prompt, bs)
        assert watch.hits([*prompt, 5])["d0"] == full == len(keys) * bs
        assert watch.consumer.subscribers["d0"].malformed == 0
    finally:
        watch.close()

    endpoints = cluster.kv_event_endpoints(cluster.node("d0"))
    assert endpoints is not None and endpoints.replay is not None
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoints.replay)
        dealer.send_multipart((b"", encode_replay_request(0)))
        stored: list[BlockStored] = []
        while True:
            assert dealer.poll(30_000), "the replay did not end"
            reply = decode_replay_reply(dealer.recv_multipart()[1:])
            if reply is None:
                break
            stored += [e for e in decode_batch(reply[1]).events if isinstance(e, BlockStored)]
    finally:
        dealer.close()
        ctx.term()
    # The prompt's chain: its first block (no parent), then each block whose parent is the last.
    by_parent = {block_key(e.parent_block_hash): e for e in stored if e.parent_block_hash is not None}
    firsts = [e for e in stored if e.parent_block_hash is None and e.token_ids[:bs] == tuple(prompt[:bs])]
    assert firsts, "no BlockStored for the prompt's first block in d0's replay"
    published: list[int] = []
    tokens: list[int] = []
    event: BlockStored | None = firsts[-1]
    while event is not None and len(published) < len(keys):
        published += [block_key(h) for h in event.block_hashes]
        tokens += event.token_ids
        event = by_parent.get(published[-1])
    assert published[: len(keys)] == keys  # vLLM's int keys: the digests' low 64 bits
    assert tokens[: len(keys) * bs] == prompt[: len(keys) * bs]
    assert all(e.block_size == bs for e in stored)


# -- deflect: the schedule covers the uncached tokens ---------------------------------------------
def test_deflected_request_over_a_cached_prefix_runs_its_schedule_over_the_uncached_tokens(
    vllm_cluster: VllmCluster, events: EventWatch
) -> None:
    """Turn 2 of a conversation whose turn 1 d0 served: Kairos predicts d0's hit from d0's events,
    plans the schedule over the rest, and d0 runs exactly that schedule from the first uncached
    token; vLLM's own report of the hit is the prediction."""
    cluster = vllm_cluster
    history = turn_one(cluster, events, "d0", token_prompt(300, seed=1002), answer=100)
    prompt = history + token_prompt(230, seed=1003)
    predicted = events.hits(prompt)["d0"]
    assert predicted == held_by_node(len(history) - 1, events.block_size()) > 0
    uncached = len(prompt) - predicted
    sizes = [100, 60, uncached - 160]  # what the dispatcher sends: chunks summing to the uncached tokens

    out, chunks = deflect(cluster, prompt, sizes)

    assert cached_tokens(out) == predicted  # vLLM's usage.prompt_tokens_details
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert [t for t, _ in chunks] == sizes
    assert [cached for _, cached in chunks] == [predicted, predicted + 100, predicted + 160]


@pytest.mark.parametrize("planned_over_actual", [-1, +1], ids=["hit-larger-than-planned", "hit-smaller-than-planned"])
def test_a_hit_other_than_the_planned_one_runs_the_schedule_from_the_real_hit(
    vllm_cluster: VllmCluster, events: EventWatch, planned_over_actual: int
) -> None:
    """The dispatcher planned on a hit one block off d0's (its index a little behind d0's cache):
    the schedule still starts at the first token vLLM computes; with a larger real hit it ends
    early (its last chunk cut to what is left), with a smaller one its last size repeats. No
    chunk is larger than planned, and vLLM reports the hit it found."""
    cluster = vllm_cluster
    seed = 1010 + planned_over_actual
    history = turn_one(cluster, events, "d0", token_prompt(280, seed=seed), answer=8)
    prompt = history + token_prompt(500, seed=seed + 100)
    bs = events.block_size()
    hit = events.hits(prompt)["d0"]
    assert hit >= 2 * bs
    planned_hit = hit + planned_over_actual * bs
    sizes = [150, 120, len(prompt) - planned_hit - 270]
    assert sizes[-1] > 0

    out, chunks = deflect(cluster, prompt, sizes)

    assert cached_tokens(out) == hit
    assert [t for t, _ in chunks] == expected_chunks(sizes, len(prompt) - hit)
    assert chunks[0][1] == hit and all(t <= max(sizes) for t, _ in chunks)
    assert sum(t for t, _ in chunks) == len(prompt) - hit


# -- keep: the decode node pulls only the blocks it lacks -----------------------------------------
def keep(cluster: VllmCluster, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A keep (prefill on p0, KV pulled by d0) with the dispatcher's headers, through d0's sidecar."""
    headers = {c.H_REQUEST_ID: f"keep-{uuid.uuid4().hex[:8]}", c.H_ROUTE: "keep", c.H_DECODE_NODE: "d0"}
    headers[c.H_PREFILL_HOST] = cluster.node("p0").url
    cluster.wait_for_heartbeats(timeout_s=30)  # p0 on the sidecar's live allowlist
    status, resp_headers, out = post_json(sidecar_url(cluster), completion(prompt, max_tokens, **extra), headers, 120)
    assert status == 200, out
    assert resp_headers[c.H_ROUTE] == "keep"
    return out


def test_keep_request_pulls_only_the_blocks_the_decode_node_lacks(
    vllm_cluster: VllmCluster, events: EventWatch
) -> None:
    """A conversation kept twice (prefilled on p0, decoded on d0). Turn 2: p0 computes only what
    its cache lacks (turn 1's prompt it holds), d0 takes its own cached prefix (turn 1's prompt
    and answer) locally and pulls only the rest over NIXL. vLLM's prompt_tokens_by_source on each
    node agrees with the hits Kairos predicts for it, and NIXL's bytes on d0 shrink with the
    blocks it no longer pulls."""
    cluster = vllm_cluster
    bs = events.block_size()
    d_metrics, p_metrics = (f"http://{cluster.node(n).url}/metrics" for n in ("d0", "p0"))
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")

    def counters() -> dict[tuple[str, str], float]:
        out = {(n, s): metric(url, SRC, source=s) for n, url in (("d0", d_metrics), ("p0", p_metrics)) for s in sources}
        out[("d0", "bytes")] = metric(d_metrics, "vllm:nixl_bytes_transferred_sum")
        return out

    def pulled_bytes(before: dict[tuple[str, str], float]) -> float:
        """NIXL's bytes into d0 since ``before``, once its stats (a step behind) have them."""
        wait_until(
            lambda: metric(d_metrics, "vllm:nixl_bytes_transferred_sum") > before[("d0", "bytes")], 30.0, "NIXL stats"
        )
        return metric(d_metrics, "vllm:nixl_bytes_transferred_sum") - before[("d0", "bytes")]

    first = token_prompt(330, seed=1020)
    before = counters()
    history = first + returned_ids(keep(cluster, first, 60, return_token_ids=True, ignore_eos=True))
    bytes_first = pulled_bytes(before)
    wait_until(
        lambda: events.hits([*history, 5])["d0"] >= held_by_node(len(history) - 1, bs), 30.0, "turn 1 cached on d0"
    )
    prompt = history + token_prompt(260, seed=1021)
    predicted = events.hits(prompt)
    assert predicted["d0"] == held_by_node(len(history) - 1, bs) > held_by_node(len(first), bs)
    assert predicted["p0"] == held_by_node(len(first), bs) > 0  # p0 computed turn 1's prompt only
    before = counters()

    keep(cluster, prompt, 6)

    after = counters()
    delta = {k: after[k] - before[k] for k in before}
    assert delta[("p0", "local_cache_hit")] == predicted["p0"]
    assert delta[("p0", "local_compute")] == len(prompt) - predicted["p0"]
    assert delta[("d0", "local_cache_hit")] == predicted["d0"]  # d0's own prefix, not pulled
    assert delta[("d0", "external_kv_transfer")] == len(prompt) - predicted["d0"]  # only the missing blocks
    assert delta[("d0", "local_compute")] == 0
    # NIXL moves whole blocks: turn 1 pulled all of its prompt's, turn 2 only those past d0's hit.
    blocks_first = -(-len(first) // bs)
    blocks_second = -(-len(prompt) // bs) - predicted["d0"] // bs
    assert pulled_bytes(before) * blocks_first == bytes_first * blocks_second
