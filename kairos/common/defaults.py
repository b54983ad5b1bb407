"""The defaults every part shares, each written once, in one unit per quantity.

Times are in seconds and sizes in tokens. A setting that a command line or YAML file takes in
another unit (``--tbt-slo-ms``, ``heartbeat_ms``) converts at that boundary from the value here.
The paper's values (§6.1) are marked; ``tests/unit/test_defaults.py`` checks that the configs,
the compose files and the README agree with this module.
"""

from __future__ import annotations

# Algorithm 1 (the paper's §6.1)
ALPHA = 1.3  # deflect when TTFT_decode <= alpha x TTFT_prefill (Eq. 7)
BETA = 1.0  # TBT safety factor: every scheduled step <= beta x tau (Eq. 5)
TBT_SLO_S = 0.070  # tau: P95 time between tokens
TTFT_SLO_S = 4.0  # P95 time to first token
CHUNK_CANDIDATES = (2048, 1024, 512, 256, 128)  # prefill chunk sizes, strictly decreasing
# Deflected prefills a decode node may hold in flight for it to take another. The paper's §5.3
# allows one (1); None lifts the limit: a new deflection is scheduled behind the node's backlog,
# its own dispatcher's and, through their promises in Redis, the other replicas' (which on
# Bursty moves PD's knee from 4 RPS to 6, where one per node reaches 5).
MAX_PENDING_DEFLECTIONS: int | None = None

# Membership: a node with no new heartbeat for this long is stale (never deflected to). Three and
# a half heartbeat periods: one late beat on a loaded host is not an outage.
STALE_AFTER_S = 0.35

# The served model and the engines of the reference cluster (DeepSeek-V2-Lite on A100)
PROFILE = "deepseek-v2-lite-a100"  # packaged latency profile
MAX_MODEL_LEN = 32768  # tokens of context
PREFILL_STEP_TOKENS = 2048  # max_num_batched_tokens on prefill nodes (chi_p)
DECODE_STEP_TOKENS = 4096  # max_num_batched_tokens on decode nodes
KV_CAPACITY_TOKENS = 1_300_000  # KV-cache tokens per emulated node
KV_BLOCK_TOKENS = 16  # tokens per KV-cache block: vLLM's default --block-size, the prefix cache's unit
