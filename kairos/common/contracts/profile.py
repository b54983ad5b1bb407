"""The latency profile file's schema: read by the dispatcher, written by the profiler, used by the
simulator."""

from __future__ import annotations

PROFILE_SCHEMA_VERSION = 1

# Top-level keys of a profile file.
PROFILE_KEYS = ("schema_version", "name", "model", "hardware", "provenance", "models")

# The four models a profile carries, and for each linear model its features in the exact
# order the evaluator multiplies them. Times are in seconds, sizes in tokens.
PREFILL_STEP = "prefill_step"  # a prefill-only step on a prefill node
DECODE_STEP = "decode_step"  # a decode-only step: T0(B, K)
MIXED_INCREMENT = "mixed_increment"  # extra time of a step that also carries a prefill chunk
KV_TRANSFER = "kv_transfer"  # inter-node KV-cache transfer

LINEAR_MODEL_FEATURES: dict[str, tuple[str, ...]] = {
    # n = prefill tokens in the step, c = tokens already cached for the prefilling request(s)
    PREFILL_STEP: ("tokens", "tokens_over_knee", "tokens_x_cached"),
    # B = decode tokens in the step (one per running decode), K = KV tokens held by the node
    DECODE_STEP: ("decode_tokens", "kv_tokens"),
    # chi = total step tokens, p = chi - B prefill tokens, c = the deflected prefill's cached tokens
    MIXED_INCREMENT: (
        "prefill_tokens",
        "prefill_tokens_x_decode_tokens",
        "prefill_tokens_x_kv_tokens",
        "prefill_tokens_x_cached_tokens",
        "step_tokens_over_knee",
    ),
}

# Models whose features include a "*_over_knee" term carry the knee (tokens) beside them.
KNEE_MODELS = (PREFILL_STEP, MIXED_INCREMENT)
