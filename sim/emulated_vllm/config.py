"""An emulated vLLM node's settings (:class:`EmulatedNodeConfig`), and the vLLM release it follows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kairos.common import defaults
from kairos.common.config import ConfigSource, setting
from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KvEventsConfig
from kairos.core.latency import DEFAULT_PROFILE

PULL_TIMEOUT_S = 10.0  # wall seconds for the pull call itself (validation only, no data moves)
PULL_KEEPALIVE_S = 1.0  # wall seconds a decode node reuses an idle pull connection (nodes close at 5)


@dataclass(frozen=True)
class EmulatedNodeConfig:
    """One emulated vLLM node. Durations are model seconds (divided by ``time_scale`` on the wall)."""

    node_id: str = setting(help='this node\'s id, unique in the cluster (e.g. "d0")')
    # prefill: serves hop 1 and holds KV for pulls; decode: pulls KV, runs deflected prefills.
    role: Role = setting(help="the node's role in the cluster")
    model_dir: str = setting(help="the served model's directory, with tokenizer.json (and a chat template)")
    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(0, help="listen port (0: any free port, printed at start-up)")
    model: str = setting(
        "", help="served model id (empty: --model-dir, as vLLM does)", flags=("--model", "--served-model-name")
    )
    profile: str = setting(DEFAULT_PROFILE, help="latency profile: a packaged name or a JSON path")
    max_model_len: int = setting(defaults.MAX_MODEL_LEN, help="prompt + output tokens per request (vLLM's)")
    max_step_tokens: int = setting(
        2048, help="tokens per engine step", flags=("--max-step-tokens", "--max-num-batched-tokens")
    )
    kv_capacity_tokens: int = setting(defaults.KV_CAPACITY_TOKENS, help="KV cache size in tokens")
    max_running: int = setting(256, help="resident sequences", flags=("--max-running", "--max-num-seqs"))
    time_scale: float = setting(1.0, help="10 = ten times faster than real time (durations are model seconds)")
    # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT and its default. Wall, not model time, as in vLLM:
    # at --time-scale 1000 a model-time hold lasted 120 ms, less than a gateway's hops on a loaded
    # host take to send the decode request.
    kv_hold_timeout_s: float = setting(480.0, help="prefill node: wall seconds it keeps KV nobody has pulled")
    # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE and its default: a client that reuses a connection after
    # a pause races this close, on a real node and so here. Over PULL_KEEPALIVE_S.
    keep_alive_timeout_s: float = setting(5.0, help="wall seconds an idle kept-alive connection stays open")
    max_body_bytes: int = setting(
        defaults.MAX_REQUEST_BODY_BYTES, help="larger request bodies are answered 413 before they are parsed"
    )
    step_log_size: int = setting(10_000, help="engine steps kept for /kairos/steps")
    prefix_caching: bool = setting(
        True, help="vLLM's prefix caching", flags=("--enable-prefix-caching",), form="negatable"
    )
    block_size: int = setting(defaults.KV_BLOCK_TOKENS, help="tokens per KV block (and per block hash)")
    enable_prompt_tokens_details: bool = setting(
        False, help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag)", form="switch"
    )
    kv_events_config: str | None = setting(None, help="vLLM's KVEventsConfig as JSON: publish KV cache events")
    # Off: a node whose vLLM runs stock NixlConnector (no kv_connector_module_path) with the Kairos
    # plugins, as an operator's own node may: the validator refuses a split's decode hop with its 400.
    split_connector: bool = setting(
        True,
        help="the node's vLLM loads Kairos's split connector (off: a split's decode hop is refused, as there)",
        form="negatable",
    )

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ConfigError("EmulatedNodeConfig.node_id must not be empty")
        if not self.model_dir:
            raise ConfigError("EmulatedNodeConfig.model_dir must not be empty")
        object.__setattr__(self, "role", Role(self.role))
        if not self.model:
            object.__setattr__(self, "model", self.model_dir)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ConfigError(f"time_scale must be a positive number, got {self.time_scale}")
        if not (self.kv_hold_timeout_s > 0 and math.isfinite(self.kv_hold_timeout_s)):
            raise ConfigError(f"kv_hold_timeout_s must be a positive number, got {self.kv_hold_timeout_s}")
        if not (self.keep_alive_timeout_s > PULL_KEEPALIVE_S and math.isfinite(self.keep_alive_timeout_s)):
            raise ConfigError(
                f"keep_alive_timeout_s must be a number over {PULL_KEEPALIVE_S:g} (the decode nodes reuse a KV pull "
                f"connection that long), got {self.keep_alive_timeout_s}"
            )
        for name in (
            "max_model_len",
            "max_step_tokens",
            "kv_capacity_tokens",
            "max_running",
            "max_body_bytes",
            "step_log_size",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (one prompt and one output token), got {self.max_model_len}")
        # The engine admits a prompt only when it and its first token fit, and never preempts:
        # a request the context allows must always fit an empty cache.
        if self.kv_capacity_tokens < self.max_model_len:
            raise ConfigError(
                f"kv_capacity_tokens={self.kv_capacity_tokens} must be >= max_model_len={self.max_model_len}"
            )
        _ = self.kv_events  # refuse a malformed --kv-events-config at start-up, as vLLM does

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """The parsed ``kv_events_config``; None when the node publishes no events."""
        if self.kv_events_config is None:
            return None
        try:
            parsed = KvEventsConfig.from_json(self.kv_events_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return parsed if parsed.publishes else None


EMULATED_VLLM_VERSION = "0.32.0"  # the vLLM release whose wire behaviour this node follows


SOURCE = ConfigSource(
    EmulatedNodeConfig, section="emulated_node", env_prefix="KAIROS_EMU_", module="kairos.sim.emulated_vllm"
)
