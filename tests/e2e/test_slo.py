"""Per-request SLOs through the gateway (Envoy, the dispatcher, a sidecar, emulated nodes): a
request's own x-slo-ttft-ms is the bound its decision is made with, the response says which SLOs
and class it was decided with, and a bad SLO header is an OpenAI-style 400."""

from __future__ import annotations

import uuid

from kairos.api.tokenizer import PromptTokenizer
from kairos.launcher.local_cluster import LocalCluster
from tests.e2e.conftest import http, load_prefill_queues, post_json, text_of

MODEL = "kairos-tiny-llama"


def test_the_request_ttft_slo_is_the_bound_it_is_decided_with(
    cluster: LocalCluster, tokenizer: PromptTokenizer
) -> None:
    threads = load_prefill_queues(cluster, tokenizer)
    prompt = text_of(tokenizer, 1500)
    url = f"{cluster.gateway_url}/v1/completions"
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    # With the cluster's SLO (4 s): deflected, as a saturated prefill pool makes a decode node faster.
    status, headers, body = post_json(url, payload, {"x-request-id": f"e2e-{uuid.uuid4().hex[:12]}"})
    assert status == 200, body
    assert headers["x-kairos-route"] == "deflect", {k: v for k, v in headers.items() if k.startswith("x-kairos")}
    assert (headers["x-kairos-slo-ttft-ms"], headers["x-kairos-slo-tpot-ms"]) == ("4000", "70")
    assert headers["x-kairos-slo-class"] == "standard"
    predicted = float(headers["x-kairos-predicted-ttft-decode-ms"])
    # The same request with a TTFT SLO under that deflection's predicted TTFT: Eq. 7's SLO clause keeps it.
    tight = f"{predicted / 2:.1f}"
    status, headers, body = post_json(url, payload, {"x-slo-ttft-ms": tight, "x-slo-tpot-ms": "60"})
    assert status == 200, body
    assert (headers["x-kairos-route"], headers["x-kairos-reason"]) == ("keep", "keep_decode_over_slo")
    assert (headers["x-kairos-slo-ttft-ms"], headers["x-kairos-slo-tpot-ms"]) == (f"{float(tight):g}", "60")
    assert headers["x-kairos-slo-class"] == "interactive"
    assert body["usage"]["completion_tokens"] == 4
    for t in threads:
        t.join(timeout=60)


def test_a_bad_slo_header_is_an_openai_400(cluster: LocalCluster) -> None:
    url = f"{cluster.gateway_url}/v1/completions"
    for name, value in (("x-slo-ttft-ms", "soon"), ("x-slo-tpot-ms", "0")):
        status, headers, body = post_json(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, {name: value})
        assert status == 400, body
        assert headers["content-type"].startswith("application/json")
        assert body["error"]["code"] == "invalid_request" and name in body["error"]["message"]
    # A bad priority (vLLM's field) too, and the gateway still serves.
    status, _, body = post_json(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": "high"})
    assert status == 400 and body["error"]["param"] == "priority", body
    status, _, _ = http("GET", f"{cluster.gateway_url}/v1/models")
    assert status == 200
