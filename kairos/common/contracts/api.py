"""The public API: what the gateway's port serves."""

from __future__ import annotations

from collections.abc import Mapping

# ---------------------------------------------------------------------------------------------
# The public API: what the gateway's port serves (Envoy routes exactly these paths, the
# dispatcher checks the methods, a decode sidecar relays the non-inference ones to its vLLM);
# any other path is a JSON 404 from Envoy. Node- and sidecar-internal endpoints (/metrics,
# /kairos/state, /kairos/steps, the KV pull, /kairos/metrics) are reachable on their own ports only.
# ---------------------------------------------------------------------------------------------
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")  # POST: routed by Algorithm 1
PUBLIC_ENDPOINTS: Mapping[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),  # the decode sidecar's: 200 when its local vLLM is
    "/tokenize": ("POST",),  # vLLM's; `vllm bench serve` calls it first
    "/detokenize": ("POST",),
    "/version": ("GET",),
}
