"""Real vLLM on CPU behind the gateway: a batch or n > 1 fanned out through Envoy (each prompt's
each choice a keep request of its own, prefilled on p0 and pulled to d0 over NIXL) and merged by
the sidecar answers as d0's own vLLM answers the same request sent to it directly."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.launcher.vllm_cluster import VllmCluster
from tests.e2e.conftest import http
from tests.integration.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm

# The usage fields both answers share exactly; prompt_tokens_details.cached_tokens says what each
# path found cached (d0 pulled these prompts' KV first, so a direct request hits its cache).
COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def token_prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 4000 for i in range(n)]


def post(url: str, body: dict[str, Any], rid: str) -> tuple[int, dict[str, str], bytes]:
    return http("POST", url, json.dumps(body).encode(), {"content-type": "application/json", c.H_REQUEST_ID: rid}, 180)


def both(cluster: VllmCluster, body: dict[str, Any]) -> tuple[tuple[dict[str, str], bytes], bytes]:
    """The gateway's answer (headers, body) and d0's own answer to ``body``."""
    tag = uuid.uuid4().hex[:8]
    status, headers, via_gateway = post(f"{cluster.gateway_url}/v1/completions", body, f"gw-{tag}")
    assert status == 200, via_gateway[:500]
    status, _, direct = post(f"http://{cluster.node('d0').url}/v1/completions", body, f"d0-{tag}")
    assert status == 200, direct[:500]
    return (headers, via_gateway), direct


def assert_same_answer(gateway: dict[str, Any], direct: dict[str, Any]) -> None:
    assert list(gateway) == list(direct)  # the same fields, in vLLM's order
    assert gateway["choices"] == direct["choices"]  # every field of every choice, in order
    assert {k: gateway["usage"][k] for k in COUNTS} == {k: direct["usage"][k] for k in COUNTS}
    assert list(gateway["usage"]) == list(direct["usage"])
    assert set(gateway["usage"]["prompt_tokens_details"] or {}) == set(direct["usage"]["prompt_tokens_details"] or {})
    for field in ("object", "model", "system_fingerprint", "kv_transfer_params", "metrics"):
        assert gateway[field] == direct[field], field


@pytest.mark.parametrize(
    "prompts",
    [
        pytest.param([token_prompt(150, 31), token_prompt(40, 32), token_prompt(300, 33)], id="token-id lists"),
        pytest.param(["the quick brown fox jumps over", "a lazy dog sleeps in the sun all day long"], id="strings"),
    ],
)
def test_a_batch_through_the_gateway_answers_as_vllm_itself(vllm_cluster: VllmCluster, prompts: list[Any]) -> None:
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 6, "temperature": 0}
    (headers, raw), direct = both(vllm_cluster, body)
    assert headers[c.H_ROUTE] == c.ROUTE_FANOUT
    gateway = json.loads(raw)
    assert gateway["id"] == f"cmpl-{headers[c.H_REQUEST_ID]}"
    assert_same_answer(gateway, json.loads(direct))


def stream_events(raw: bytes) -> list[Any]:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def test_a_streamed_batch_through_the_gateway_streams_as_vllm_itself(vllm_cluster: VllmCluster) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": [token_prompt(120, 41), token_prompt(60, 42)],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    (headers, raw), direct_raw = both(vllm_cluster, body)
    assert headers["content-type"].startswith("text/event-stream")
    gateway, direct = stream_events(raw), stream_events(direct_raw)
    for events in (gateway, direct):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert len({e["id"] for e in events[:-1]}) == 1
    # How many chunks carry the text is vLLM's timing, not a contract: its output collector
    # merges the deltas a slow reader has not taken yet (vllm/v1/engine/output_processor.py),
    # so a starved host streams the same tokens in fewer, longer pieces. What must match: every
    # chunk's fields in vLLM's order, and per choice index the text, its finish and their fields.
    assert {tuple(e) for e in gateway[:-2]} == {tuple(e) for e in direct[:-2]}

    def by_index(events: list[Any]) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = defaultdict(lambda: {"text": "", "finish": [], "fields": set()})
        for e in events:
            for ch in e["choices"]:
                seen = out[ch["index"]]
                seen["text"] += ch["text"]
                seen["fields"].add(tuple(ch))
                if ch["finish_reason"] is not None:
                    seen["finish"].append((ch["finish_reason"], ch.get("stop_reason")))
        return dict(out)

    per_choice = by_index(gateway[:-2])
    assert per_choice == by_index(direct[:-2])
    assert sorted(per_choice) == [0, 1] and all(len(seen["finish"]) == 1 for seen in per_choice.values())
    final, expected = gateway[-2], direct[-2]
    assert list(final) == list(expected) and final["choices"] == []
    assert {k: final["usage"][k] for k in COUNTS} == {k: expected["usage"][k] for k in COUNTS}
    assert final["system_fingerprint"] == expected["system_fingerprint"]


def test_n_choices_through_the_gateway_are_vllms_own(vllm_cluster: VllmCluster) -> None:
    """Seeded sampling: vLLM gives child request j the seed + j, and so does the fan-out to each
    choice's own request, so the gateway's choices are the very ones d0 gives the request alone,
    and a batch's with n 2 too (prompt p's choice j at p * 2 + j). Each choice has its own
    prefill and KV transfer: p0 never sees a second read of blocks it freed (which n child
    requests of one decode hop would make, vLLM logging each)."""
    single = {"model": MODEL_NAME, "prompt": token_prompt(200, 51), "max_tokens": 5, "n": 3, "seed": 7}
    (headers, raw), direct = both(vllm_cluster, {**single, "temperature": 1.0})
    assert headers[c.H_ROUTE] == c.ROUTE_FANOUT
    assert_same_answer(json.loads(raw), json.loads(direct))
    p0_log = (vllm_cluster.workdir / "logs" / "p0-vllm.log").read_text(errors="replace")
    assert f"unrecognized request cmpl-{headers[c.H_REQUEST_ID]}" not in p0_log

    batch = {**single, "prompt": [token_prompt(90, 52), token_prompt(130, 53)], "n": 2, "temperature": 0.8}
    (_, raw), direct = both(vllm_cluster, batch)
    gateway = json.loads(raw)
    assert [ch["index"] for ch in gateway["choices"]] == [0, 1, 2, 3]
    assert_same_answer(gateway, json.loads(direct))


def test_a_batch_vllm_refuses_is_refused_alike(vllm_cluster: VllmCluster) -> None:
    """The gateway checks every prompt before anything runs; vLLM refuses the batch whole too."""
    for fields in ({"prompt": [token_prompt(10, 61), [5, 99999]]}, {"prompt": ["a", "b"], "n": 2, "temperature": 0}):
        body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
        status, _, raw = post(f"{vllm_cluster.gateway_url}/v1/completions", body, f"bad-{uuid.uuid4().hex[:6]}")
        direct_status, _, direct = post(f"http://{vllm_cluster.node('d0').url}/v1/completions", body, "bad-direct")
        assert (status, direct_status) == (400, 400), (raw, direct)
        assert "error" in json.loads(raw) and "error" in json.loads(direct)
