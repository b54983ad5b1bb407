"""An emulated vLLM node: vLLM's OpenAI-compatible HTTP API over the clock-free engine model.

Machines without GPUs run the whole gateway against these nodes; swapping in real vLLM changes
nothing else. What the node does:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the prompt is counted with the model's
  tokenizer (exactly vLLM's ``usage.prompt_tokens``), the engine model runs it in wall time
  (:mod:`kairos.sim.realtime`) and exactly ``max_tokens`` dummy tokens come back (vLLM with
  ``ignore_eos``), as JSON or as vLLM's SSE chunks, each token written when its step ends.
- Prefix caching, on by default as in vLLM (``--no-enable-prefix-caching`` turns it off): the
  prompt's token ids are hashed per ``--block-size`` block exactly as vLLM hashes them
  (:mod:`kairos.common.block_hash`), the request starts from its longest cached prefix (the
  engine model's block cache), and ``--enable-prompt-tokens-details`` reports
  ``usage.prompt_tokens_details.cached_tokens`` as vLLM does. ``--kv-events-config`` publishes the
  cache's changes as vLLM does, on ZMQ with a replay socket (:mod:`kairos.sim.kv_event_publisher`).
- The P/D two-hop protocol of vLLM's NixlConnector (``toy_proxy_server.py``): a prefill node
  asked for ``kv_transfer_params.do_remote_decode`` prefills, holds the KV and answers with
  ``kv_transfer_params`` saying where it is; a decode node given ``do_remote_prefill`` reserves KV
  room, pulls from the prefill node (``POST /kairos/kv/pull``), waits the modelled transfer time
  and decodes. As vLLM's NixlConnector, the decode node first takes the prompt's prefix from its
  own cache and pulls only the blocks it lacks. The prefill hop's ``kv_transfer_params`` are vLLM
  0.32's (block ids per KV cache group, ``remote_num_tokens``: the prompt tokens it computed).
- The split route's decode hop: ``remote_num_tokens`` short of the prompt (the prefill node ran
  only the prompt's first k tokens) pulls those k tokens' blocks, then prefills the rest as a
  scheduled prefill under the request's ``vllm_xargs`` schedule and step budget, then decodes;
  its step records and ``vllm:prompt_tokens_by_source`` say which tokens came from where.
- Deflected prefills: ``vllm_xargs.kairos_chunk_schedule`` (and ``kairos_step_budget_ms``) make
  the engine prefill with exactly that chunk schedule, as the Kairos scheduler plugin does; a
  malformed one is refused by the plugin's own parser with vLLM's very answer (status, body).
- ``vllm_xargs.kairos_tpot_slo_ms`` (any request): its TPOT SLO. As the plugin, a deflected
  chunk's step budget is held to its running decodes' tightest TPOT (the engine's guard), and a
  decode node's ``/kairos/state`` reports the tightest TPOT among its requests (``tpot_slo_ms``).
- ``GET /v1/models``, ``/health``, ``/metrics`` (vLLM's metric names), ``/kairos/state`` (what the
  heartbeat publisher reads) and ``/kairos/steps?since=N`` (the step log).

    python -m kairos.sim.emulated_vllm --node-id d0 --role decode --port 8101 --model-dir DIR --time-scale 10

One module per seam, each importing only those above it:

- ``config``: :class:`EmulatedNodeConfig`, the KV pull client's bounds, the vLLM release followed;
- ``metrics``: the node's Prometheus metrics in vLLM's names;
- ``responses``: the answers in vLLM's shapes (JSON, SSE chunks, usage) and the words it streams;
- ``validation``: ``vllm_xargs`` and ``kv_transfer_params`` read as vLLM reads them, its refusals;
- ``kv_transfer``: KV hold (prefill side) and pull (decode side), the P/D hand-off;
- ``endpoints``: the rest of vLLM's API (models, health, version, tokenize, detokenize);
- ``reports``: ``/metrics``, ``/kairos/state`` and ``/kairos/steps``;
- ``node``: :class:`EmulatedNode`, its engine in wall time and its completions (the engine glue);
  the last three are its bases;
- ``app``: the aiohttp application, its routes and its error answers;
- ``service``: the command line, the application as it is served, and the service's start-up.

Every module logs to this package's logger (``kairos.sim.emulated_vllm``). This package exports
what callers import; the names its modules share only among themselves are imported from the
module that defines them.
"""

from kairos.sim.emulated_vllm.app import NODE_KEY, build_app
from kairos.sim.emulated_vllm.config import (
    EMULATED_VLLM_VERSION,
    PULL_KEEPALIVE_S,
    PULL_TIMEOUT_S,
    SOURCE,
    EmulatedNodeConfig,
)
from kairos.sim.emulated_vllm.kv_transfer import KV_PULL_PATH
from kairos.sim.emulated_vllm.metrics import PROMPT_SOURCES
from kairos.sim.emulated_vllm.node import TOKENIZE_INLINE_BYTES, EmulatedNode
from kairos.sim.emulated_vllm.responses import one_token_words
from kairos.sim.emulated_vllm.service import (
    SERVICE,
    VLLM_MAX_HEAD_BYTES,
    VLLM_MAX_HEADERS,
    app_runner,
    build_parser,
    main,
    serve,
)

__all__ = [
    "EMULATED_VLLM_VERSION",
    "KV_PULL_PATH",
    "NODE_KEY",
    "PROMPT_SOURCES",
    "PULL_KEEPALIVE_S",
    "PULL_TIMEOUT_S",
    "SERVICE",
    "SOURCE",
    "TOKENIZE_INLINE_BYTES",
    "VLLM_MAX_HEADERS",
    "VLLM_MAX_HEAD_BYTES",
    "EmulatedNode",
    "EmulatedNodeConfig",
    "app_runner",
    "build_app",
    "build_parser",
    "main",
    "one_token_words",
    "serve",
]
