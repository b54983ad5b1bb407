"""The defaults every part shares, each written once, in one unit per quantity.

Times are in seconds and sizes in tokens. A setting that a command line or YAML file takes in
another unit (``--tbt-slo-ms``, ``heartbeat_ms``) converts at that boundary from the value here.
The paper's values (§6.1) are marked; ``tests/unit/test_defaults.py`` checks that the configs,
the compose files and docs/design agree with this module.
"""

from __future__ import annotations

# Algorithm 1 (the paper's §6.1)
# Deflect when TTFT_decode <= alpha x TTFT_prefill (Eq. 7). The paper's 1.3 lets a request take a
# decode path up to 30% slower than its keep path, on the argument that it frees the prefill
# queue; measured, that trade loses: a slower deflection spends the decode nodes' TBT budget that
# the next requests of a burst need (2P2D simulator, Bursty 5 RPS 180 s seed 1, P95 TTFT vs P/D:
# 0.89x at 1.3, 0.81x at 1.15, 0.77x at 1.0). ``kairos:alpha=1.3`` is the paper's.
ALPHA = 1.0
BETA = 1.0  # TBT safety factor: every scheduled step <= beta x tau (Eq. 5)
TBT_SLO_S = 0.070  # tau: P95 time between tokens
TTFT_SLO_S = 4.0  # P95 time to first token
# Step sizes a deflected prefill's steps are planned at (Eq. 5: the step's decode tokens plus its
# chunk), strictly decreasing: four per octave. The paper's powers of two leave a step up to half
# its tokens short of the budget; on Bursty a decode node's deflected steps then ran 63.6 ms on
# average under a 70 ms budget (chunks of ~235 tokens where ~330 fit), and a finer grid fills it
# (2P2D simulator, seed 90417: Bursty's knee 6 -> 6.5 RPS, HPLD's 1.5 -> 1.75;
# docs/design/chunk-sizes.md). ``kairos:chunks=2048/1024/512/256/128`` plans with the paper's.
CHUNK_CANDIDATES = (2048, 1792, 1536, 1280, 1024, 896, 768, 640, 512, 448, 384, 320, 256, 224, 192, 160, 128)
PAPER_CHUNK_CANDIDATES = (2048, 1024, 512, 256, 128)  # the paper's §6.1
# Deflected prefills a decode node may hold in flight for it to take another. The paper's §5.3
# allows one (1); None lifts the limit: a new deflection is scheduled behind the node's backlog,
# its own dispatcher's and, through their promises in Redis, the other replicas' (which on
# Bursty moves PD's knee from 4 RPS to 6, where one per node reaches 5).
MAX_PENDING_DEFLECTIONS: int | None = None

# Decode pressure (kairos.core.algorithm.decode_pressure_refusal, "never worse than P/D"): while
# the keep path meets the TTFT SLO, a decode node whose decode-only step with the request joined
# is over this share of the overload line (min(tau, beta tau), not divided by the node's step
# calibration: the step error has its margin in the calibrated lines) takes no deflection. Near
# that line its steps already run over tau on batch swings alone (P/D's own violations start
# there), and the chunks would take decode time from the cluster's bottleneck to shave a TTFT
# that meets its SLO anyway.
# 2P2D, seeds 90417 and 1-4, azure_conv 17 RPS: attainment -0.30 points vs P/D without it, -0.06
# with it; Bursty's deflections under pressure rescue keeps that miss the SLO, and stay.
DECODE_PRESSURE_SHARE: float | None = 0.85

# The deflection gate (kairos.core.algorithm.deflection_gate_open): no deflection while the keep
# path's TTFT estimate is under this share of the TTFT SLO (1 s of 4 s). There the keep path meets
# the SLO with room, and a deflection can only trade a TTFT that needs no saving for decode steps
# that the decodes beside its chunks pay in TBT (live, a multi-turn replay at low load: 404
# deflections, TBT violations 0.57% against P/D's 0.01%, attainment 99.0% against 100%). None:
# Eq. 7 decides alone (the paper). With it, Kairos meets the never-worse limits at all 15 points of
# bench/sim/never_worse.py (one miss without), and keeps every knee (docs/design/never-worse.md).
DEFLECT_GATE_SHARE: float | None = 0.25

# The keep path's TTFT estimate (Eq. 1 plus what the paper leaves out; kairos.core.algorithm).
KEEP_ESTIMATE = "full"  # "full": Eq. 1 + KV transfer + link queue + admission + first decode step; "eq1": the paper's
# The split route (kairos.core.algorithm.split): which k, and how finely the k search cuts the prompt.
SPLIT = "off"
SPLIT_POINTS = 8
# Decode-side admission: a running decode's remaining output tokens, memoryless (the Bursty
# workload's geometric completions, mean 72). Only its KV-freeing rate matters, and only when a
# decode node's KV cannot take a keep-path request's prompt.
MEAN_OUTPUT_TOKENS = 72.0

# Membership: a node with no new heartbeat for this long is stale (never deflected to). Three and
# a half heartbeat periods: one late beat on a loaded host is not an outage.
STALE_AFTER_S = 0.35

# Redis connections (kairos.common.redis_client). A command gives up after its caller's short
# budget (0.2-0.25 s: each caller retries on its own period), but a connection is made once and
# reused, and its set-up (TCP, then TLS for rediss://) takes several round trips: a distant Redis
# or a busy host needs more than one command's budget. At 0.25 s a TLS connect on a loaded 2-core
# host timed out, and the heartbeat, poll or sample behind it was lost; a Redis that is down
# refuses at once whatever this is.
REDIS_CONNECT_TIMEOUT_S = 2.0

# Envoy's kept-alive connections to the decode sidecars. Envoy closes one idle for
# GATEWAY_SIDECAR_IDLE_S, before the sidecar's own idle close (SIDECAR_KEEP_ALIVE_S) can race a
# request into it: such a request would be reset, and Envoy's retry sends it to another decode
# node than the one its decision named.
SIDECAR_KEEP_ALIVE_S = 75.0
GATEWAY_SIDECAR_IDLE_S = 60.0

# Envoy's limits on a request's head (its own defaults, written into the gateway's config): a
# client's head past them gets Envoy's 431. The dispatcher's routing headers (x-kairos-*,
# x-request-id) are checked against the same limits once added, and Envoy fails a mutation past
# them with a 503, so the dispatcher refuses (431) a head that leaves its headers no room.
GATEWAY_MAX_REQUEST_HEADERS = 100
GATEWAY_MAX_REQUEST_HEADERS_KB = 60
# The largest request body the dispatcher reads (a longer one gets 413 before any parsing).
MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# A request the dispatcher refuses from its head while its body is still coming (a Content-Length
# over the limit, a compressed body, an unserved method) is answered once Envoy has read and
# dropped that body, if it declares at most this many bytes: Envoy stops reading a connection it
# has answered before the request ended, and closes it a moment later, so a client still writing
# would get a reset instead of the answer. A longer declared body is answered at once (no upload
# of tens of MB to refuse). Twice the body limit: as much as Envoy's default buffer limit
# (EnvoySettings.buffer_limit_bytes), so the gateway reads up to 16 MiB of any request before
# it answers, buffered or dropped. Time is bounded by Envoy's request_timeout, as for any body.
REFUSED_BODY_DRAIN_BYTES = 2 * MAX_REQUEST_BODY_BYTES

# The served model and the engines of the reference cluster (DeepSeek-V2-Lite on A100)
PROFILE = "deepseek-v2-lite-a100"  # packaged latency profile
MAX_MODEL_LEN = 32768  # tokens of context
PREFILL_STEP_TOKENS = 2048  # max_num_batched_tokens on prefill nodes (chi_p)
DECODE_STEP_TOKENS = 4096  # max_num_batched_tokens on decode nodes
KV_CAPACITY_TOKENS = 1_300_000  # KV-cache tokens per emulated node
MAX_RUNNING_REQUESTS = 256  # sequences an engine holds at once (vLLM's max_num_seqs)

# Admission control at the dispatcher (kairos.core.admission). The cluster holds at most its decode
# seats (MAX_RUNNING_REQUESTS per decode node) and a queue as deep again: a request past that
# would start only after a whole batch turned over. Its prompts' KV must fit the decode nodes' KV
# with the same allowance. Past the budget a request waits at the dispatcher for at most
# ADMISSION_MAX_WAIT_S, in a line of at most ADMISSION_WAITING_PER_SEAT per decode seat, else gets
# a 429 with Retry-After. The wait stays under Envoy's ext_proc message timeout
# (EnvoySettings.message_timeout, 2 s), which would answer a bare 504 instead; a line longer than
# one batch per node would not drain within that second at any rate a node sustains.
ADMISSION_QUEUE_PER_SEAT = 1.0
ADMISSION_MAX_WAIT_S = 1.0
ADMISSION_WAITING_PER_SEAT = 1.0
# The dispatcher's own CPU, before any of the above: at most DISPATCHER_MAX_OPEN_STREAMS ext_proc
# streams are open on one dispatcher at once. The gRPC exchange alone costs ~1.2 ms of dispatcher
# CPU per request (bench/results/gateway_overhead.json, the no-op ext_proc) and a decision about
# as much again, so ~1,000 streams are about the 2 s of work Envoy's message timeout allows; 5,000
# opened at once ran past it (bench/results/spike.json). Envoy's breaker on the dispatcher cluster
# holds the rest of a burst in Envoy (EnvoySettings.dispatcher_streams); a stream past the bound
# that reaches a dispatcher anyway (another Envoy, an HTTP/2 client's many streams) is answered at
# once with the admission gate's 429, before it is parsed (kairos.extproc.server.BusyLimits).
DISPATCHER_MAX_OPEN_STREAMS = 1024

# The decode nodes' step-time calibration (kairos.core.calibration): the upper quantile of
# actual / predicted step time each node reports, and the dispatcher divides its step budget by.
CALIBRATION_QUANTILE = 0.99  # P(a step planned at the budget's edge runs over tau) <= 1%
CALIBRATION_HALF_LIFE_STEPS = 2000  # a step this many steps old weighs half (~100 s of 50 ms steps)
CALIBRATION_MIN_SAMPLES = 500  # steps measured before the estimate replaces the prior

# The simulator's correlated ground-truth error (--error-form correlated): the share of the
# error's variance that is a per-node bias (drawn once per node), the rest per-step noise.
SIM_ERROR_BIAS_SHARE = 0.5

# Prefix-cache residency at the dispatcher (kairos.core.prefix_index, from the nodes' KV events).
# Blocks kept per node: past this, the block stored (or stored again) longest ago is dropped, an
# under-count of the node's cache, never an over-count. 65,536 blocks of 16 tokens is 1M tokens,
# most of an emulated node's KV_CAPACITY_TOKENS. Measured 164 B per block (distinct keys, tracemalloc):
# 10.7 MB per node at the cap, so 1,000 nodes at the cap is about 11 GB in each dispatcher.
PREFIX_INDEX_CAPACITY_BLOCKS = 65_536
# Live event batches a node's stream holds while its replay is outstanding; past this the oldest
# go, and the hole they leave resets that node's index (an under-count, never a wrong hit).
KV_EVENTS_MAX_PENDING_BATCHES = 10_000
# A replay unanswered this long counts as failed, and the node's index is reset. vLLM answers
# replays from its publisher thread, which on a busy CPU host took over 1 s (a real node in the
# integration tier, 2 shared cores); waiting only holds that node's hits at 0 a little longer,
# where a reset forgets every block it cached until each is stored again.
KV_EVENTS_REPLAY_TIMEOUT_S = 5.0
KV_BLOCK_TOKENS = 16  # tokens per KV-cache block: vLLM's default --block-size, the prefix cache's unit
