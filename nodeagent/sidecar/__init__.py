"""The decode-node sidecar: carries out the dispatcher's decision beside one decode node's vLLM.

Envoy sends every request for this decode node here, with the decision in ``x-kairos-*`` headers:

  keep     hop 1: the prefill node's vLLM runs the prompt with ``max_tokens=1`` and
           ``do_remote_decode`` and answers with ``kv_transfer_params``; hop 2: the local vLLM
           gets the client's original body plus those params and pulls the KV (NixlConnector).
           This is the two-hop protocol of vLLM's ``toy_proxy_server.py`` and llm-d's sidecar.
  deflect  one hop to the local vLLM, the chunk schedule in ``vllm_xargs`` (read by the Kairos
           scheduler plugin).
  split    the prompt's token ids (the body's, or the local vLLM's ``/tokenize``: exactly what
           this node's vLLM sees); hop 1: the prefill node computes their first k
           (``x-kairos-split-tokens``) as a completions prompt of token ids, ``max_tokens=1``,
           and answers with ``kv_transfer_params`` (``remote_num_tokens`` k); hop 2: the local
           vLLM gets the client's body, those params and the schedule of the prompt's rest in
           ``vllm_xargs``: it pulls the k tokens' KV and prefills the rest itself. A prompt it
           counts otherwise than the dispatcher is served as a keep (counted, never failed), and
           so is a split whose hop 2 the local vLLM refuses because it does not load Kairos's
           split connector (its validator's 400, seen before any byte goes to the client), as
           are the splits of the minute after.
  Every route's hop to the local vLLM carries the request's TPOT SLO (``vllm_xargs``
  ``kairos_tpot_slo_ms``, from the dispatcher's ``x-kairos-slo-tpot-ms``); the client's body
  fields, vLLM's ``priority`` included, go to every hop as sent.
  fanout   a batch (several prompts): each prompt is sent back through the gateway (``--gateway``)
           for a decision of its own, and the answers merged as vLLM's (kairos.nodeagent.fanout).
  (none)   the request reached the sidecar directly: plain aggregated serving on the local vLLM.

With a Redis URL (``--redis``), the sidecar also reports each routed request's observed TTFT
beside the dispatcher's prediction: one XADD per request, after its first token, to the capped
stream ``kairos:ttft-feedback``, which the dispatchers read into their live model-error metrics.
It is fire-and-forget: a bounded queue and one writer task, so Redis being slow or gone never
delays or fails a request (samples are dropped and counted instead). Without a URL, no Redis.

TTFT is what the sidecar sees of the first token: the first event of a streamed response, which
vLLM writes once the first token is out (a chat stream's role chunk comes with it). A
non-streamed response is one JSON body that vLLM writes after the last token: its first byte
times the whole generation, so such a request has no TTFT here (no ``kairos_sidecar_ttft_seconds``
sample, no feedback) and is counted in ``kairos_sidecar_ttft_unobserved_total{reason="not_streamed"}``
instead, as are requests with no first token at all (``error``, ``aborted``). The sidecar does not
stream from vLLM and rebuild the JSON body: vLLM's non-streamed body is not its stream put
together (``prompt_logprobs``, ``kv_transfer_params`` and ``service_tier`` are only in the body,
``usage`` is in a stream only when asked for, and each vLLM version adds fields), so a rebuilt
body would in time differ from the one vLLM sends, a wrong answer to the client; and it would
cost a JSON parse per token on the sidecar's one core. A missing sample only makes the live
check smaller: the streamed requests still carry it, and the counter shows the gap.

Each completion is judged against its own SLOs at its stream's end, by the simulator's and
``kairos replay``'s definition (:func:`kairos.core.slo.meets_slo`: TTFT within its TTFT SLO, at
most 5% of its inter-token gaps over its TPOT SLO): ``kairos_sidecar_slo_requests_total{class,
outcome}`` counts it met or missed (a stream that broke off after its first token, or ended in an
error event, missed), or unobserved where nothing can be judged (not streamed, an error before
the first token, the client left), and ``kairos_sidecar_slo_goodput_tokens_total{class}`` adds
the output tokens of those that met theirs. Its SLOs are its own: the client's ``x-slo-*``
headers, else those the dispatcher decided it by, else the cluster's defaults; its class is the
dispatcher's ``x-kairos-slo-class`` where that names one of the sidecar's classes, else the class
its SLOs fall in, so a label never carries what a client sent.

Every other path (``/v1/models``, ``/metrics``, ...) is proxied to the local vLLM unchanged.
Responses stream back unbuffered. The prefill host comes from a header, so the sidecar only
calls hosts on its allowlist (static hosts plus those the live cluster view knows).

Run: ``python -m kairos.nodeagent.sidecar --port 8201 --local-vllm 127.0.0.1:8101 --allow-prefill 127.0.0.1:8001
--gateway 127.0.0.1:8000``

One module per seam, each importing only those above it:

- ``config``: :class:`SidecarConfig` and the ``host:port`` form of a host;
- ``metrics``: :class:`SidecarMetrics` and its label values (paths, unobserved reasons, SLO outcomes);
- ``feedback``: :class:`TtftFeedbackPublisher`, the TTFT samples sent to Redis;
- ``judgement``: a completion's SLO class, the SLOs it is judged by, and its outcome at its end;
- ``state``: what one app holds, under the app's keys;
- ``hygiene``: the client's body and headers checked and cleaned, and the bodies' JSON codec;
- ``hop1``: the keep's or split's prefill on the prefill node the dispatcher named (its allowlist check);
- ``hop2``: the local vLLM's body per route, and the relay of its answer (the stream's hot path);
- ``split``: the split's headers, the prompt's token ids, and its two hops' bodies;
- ``app``: the aiohttp app, its handlers, health and each request's metrics at its end;
- ``service``: the command line, the app as it is served, and the service's start-up.

Every module logs to this package's logger (``kairos.nodeagent.sidecar``). This package exports
what callers import; the names its modules share only among themselves are imported from the
module that defines them.
"""

from kairos.nodeagent.sidecar.app import build_app
from kairos.nodeagent.sidecar.config import SidecarConfig, normalize_hostport
from kairos.nodeagent.sidecar.feedback import TtftFeedbackPublisher
from kairos.nodeagent.sidecar.hop1 import HOP1_KV_TRANSFER_PARAMS
from kairos.nodeagent.sidecar.hygiene import PayloadTooLargeError
from kairos.nodeagent.sidecar.metrics import (
    ABORTED,
    NOT_STREAMED,
    PATH_LOCAL,
    PATHS,
    SLO_MET,
    SLO_MISSED,
    SLO_OUTCOMES,
    SLO_UNOBSERVED,
    UNOBSERVED,
    UNOBSERVED_ERROR,
    SidecarMetrics,
)
from kairos.nodeagent.sidecar.service import SERVICE, app_runner, build_parser, main, serve
from kairos.nodeagent.sidecar.state import METRICS, STATE

__all__ = [
    "ABORTED",
    "HOP1_KV_TRANSFER_PARAMS",
    "METRICS",
    "NOT_STREAMED",
    "PATHS",
    "PATH_LOCAL",
    "SERVICE",
    "SLO_MET",
    "SLO_MISSED",
    "SLO_OUTCOMES",
    "SLO_UNOBSERVED",
    "STATE",
    "UNOBSERVED",
    "UNOBSERVED_ERROR",
    "PayloadTooLargeError",
    "SidecarConfig",
    "SidecarMetrics",
    "TtftFeedbackPublisher",
    "app_runner",
    "build_app",
    "build_parser",
    "main",
    "normalize_hostport",
    "serve",
]
