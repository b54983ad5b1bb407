"""The public API: what the gateway's port serves (Envoy routes exactly these paths, the
dispatcher checks the methods, a decode sidecar relays the non-inference ones to its vLLM); any
other path is a JSON 404 from Envoy. Node- and sidecar-internal endpoints (/metrics,
/kairos/state, /kairos/steps, the KV pull, /kairos/metrics) are reachable on their own ports only.
"""

from __future__ import annotations

from collections.abc import Mapping

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"  # the decode sidecar's: 200 when its local vLLM is (vLLM's own, on a node)
TOKENIZE_PATH = "/tokenize"  # vLLM's; a split's sidecar asks its own vLLM for the prompt's token ids
INFERENCE_PATHS = (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH)  # POST: routed by Algorithm 1
PUBLIC_ENDPOINTS: Mapping[str, tuple[str, ...]] = {
    COMPLETIONS_PATH: ("POST",),
    CHAT_COMPLETIONS_PATH: ("POST",),
    MODELS_PATH: ("GET",),
    HEALTH_PATH: ("GET",),
    TOKENIZE_PATH: ("POST",),  # vLLM's; `vllm bench serve` calls it first
    "/detokenize": ("POST",),
    "/version": ("GET",),
}
