"""HTTP headers the dispatcher sets on a request it routes, a client's SLO headers, and the
Envoy attributes and metadata that carry them."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# HTTP headers the dispatcher sets on a request it routes (read by the decode-node sidecar)
# ---------------------------------------------------------------------------------------------
# A client's routing header (ROUTING_HEADERS, below) never reaches a sidecar: a request carrying
# one takes the gateway's headers route, where the dispatcher removes every header with this
# prefix that it does not set itself.
HEADER_PREFIX = "x-kairos-"
H_REQUEST_ID = "x-request-id"  # one id for the whole request, on both sidecar hops
H_ROUTE = "x-kairos-route"  # a Route (the decision's), or ROUTE_FANOUT (kairos.common.contracts.routes)
H_REASON = "x-kairos-reason"  # the Decision's reason (kairos.core.decision.Reason value)
H_DECODE_NODE = "x-kairos-decode-node"  # node id of the decode node chosen
H_PREFILL_HOST = "x-kairos-prefill-host"  # keep and split: host:port of the prefill node's vLLM server
# deflect: prompt tokens per step, comma-separated, e.g. "1020,508,508,252"; split: the steps of
# the prompt's tokens after the first k (what the decode node prefills itself)
H_CHUNK_SCHEDULE = "x-kairos-chunk-schedule"
# split: k, the prompt's leading tokens the prefill node computes (a multiple of the KV block,
# 0 < k < prompt tokens); the decode node pulls their KV and prefills the rest
H_SPLIT_TOKENS = "x-kairos-split-tokens"
# deflect and split: beta x tau the node enforces per chunk step; keep: the same, for a local prefill
# should the prefill node fail (the sidecar sends the prompt to its vLLM with this budget)
H_STEP_BUDGET_MS = "x-kairos-step-budget-ms"
H_PRED_TTFT_PREFILL_MS = "x-kairos-predicted-ttft-prefill-ms"
# deflect and split: Eq. 6 (a split's: its KV's landing and the rest's steps); absent when not computed
H_PRED_TTFT_DECODE_MS = "x-kairos-predicted-ttft-decode-ms"
H_PROMPT_TOKENS = "x-kairos-prompt-tokens"  # the dispatcher's prompt token count
# The prompt tokens the dispatcher predicted cached on the node that prefills the request (the
# decode node on deflect, the prefill node on keep), from the nodes' KV events; absent when none.
# Informational: a deflection's schedule covers the rest, so it sums to prompt - cached.
H_CACHED_TOKENS = "x-kairos-cached-tokens"
# The SLOs the request was decided with (kairos.core.slo): its own, or the cluster's defaults.
# TTFT bounds a deflection (Eq. 7); the sidecar passes TPOT to the decode node's vLLM
# (XARG_TPOT_SLO_MS), whose heartbeat reports the tightest among its requests (HeartbeatField.TPOT_SLO_MS).
H_DECIDED_TTFT_SLO_MS = "x-kairos-slo-ttft-ms"
H_DECIDED_TPOT_SLO_MS = "x-kairos-slo-tpot-ms"
H_SLO_CLASS = "x-kairos-slo-class"  # the class its SLOs fall in (kairos.core.slo.classify)

# A client's own SLOs, in milliseconds (llm-d's names); absent: the cluster's defaults. A request
# carrying one takes Envoy's headers route (the dispatcher reads them from its head).
H_SLO_TTFT_MS = "x-slo-ttft-ms"
H_SLO_TPOT_MS = "x-slo-tpot-ms"
SLO_HEADERS = (H_SLO_TTFT_MS, H_SLO_TPOT_MS)

# The sidecar echoes these on the response, so a client or an operator can see which path a
# request took (curl -i shows them).
ECHOED_RESPONSE_HEADERS = (
    H_ROUTE,
    H_REASON,
    H_DECODE_NODE,
    H_CHUNK_SCHEDULE,
    H_SPLIT_TOKENS,
    H_PROMPT_TOKENS,
    H_CACHED_TOKENS,
    H_PRED_TTFT_PREFILL_MS,
    H_PRED_TTFT_DECODE_MS,
    H_DECIDED_TTFT_SLO_MS,
    H_DECIDED_TPOT_SLO_MS,
    H_SLO_CLASS,
)

# Every routing header: a client request carrying any of them is never on Envoy's one-message
# route (below), so the dispatcher sees its headers and removes them.
ROUTING_HEADERS = (
    H_ROUTE,
    H_REASON,
    H_DECODE_NODE,
    H_PREFILL_HOST,
    H_CHUNK_SCHEDULE,
    H_SPLIT_TOKENS,
    H_STEP_BUDGET_MS,
    H_PRED_TTFT_PREFILL_MS,
    H_PRED_TTFT_DECODE_MS,
    H_PROMPT_TOKENS,
    H_CACHED_TOKENS,
    H_DECIDED_TTFT_SLO_MS,
    H_DECIDED_TPOT_SLO_MS,
    H_SLO_CLASS,
)

# Envoy's one-message route (envoy/envoy.yaml.j2): a plain inference request reaches the
# dispatcher as its body alone, with these facts of its head as ext_proc attributes (Envoy's
# attribute expressions, each the key of its own value, under the filter's name).
EXT_PROC_ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
ATTR_METHOD = "request.method"
ATTR_PATH = "request.path"  # with its query string, as :path
ATTR_REQUEST_ID = "request.id"  # x-request-id, as the headers message would carry it
ATTR_HEADER_COUNT = "size(request.headers)"  # pseudo-headers included, as Envoy's limits count
ATTR_TOTAL_BYTES = "request.total_size"  # the head's names and values, plus the body
ATTR_BODY_BYTES = "request.size"
HEAD_ATTRIBUTES = (ATTR_METHOD, ATTR_PATH, ATTR_REQUEST_ID, ATTR_HEADER_COUNT, ATTR_TOTAL_BYTES, ATTR_BODY_BYTES)

# Envoy's override_host load balancing reads the upstream from this dynamic metadata.
ENVOY_LB_NAMESPACE = "envoy.lb"
# The dispatcher's answer carries the headers it sets as dynamic metadata in this namespace, one
# key per header name; the gateway's routes add each as a request header (envoy.yaml.j2).
ROUTING_METADATA_NAMESPACE = "kairos.headers"
ENVOY_DESTINATION_KEY = "x-gateway-destination-endpoint"  # value: "primary,fallback" host:port list
# The grpc.health.v1 service name Envoy's health checks ask the dispatcher about: the ext_proc
# service's full proto name (SERVING while it runs, NOT_SERVING once it stops).
EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
