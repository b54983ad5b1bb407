"""The command line and environment that start a real vLLM server as a Kairos node.

One place builds them, so ``kairos up --backend vllm``, the integration tests and the README's
node recipe cannot drift apart. A node is vLLM's OpenAI server with:

- ``--scheduler-cls`` = :class:`kairos.nodeagent.vllm_plugin.scheduler.KairosScheduler` (chunk
  schedules, state reporter, step recorder), configured by ``KAIROS_VLLM_*`` variables;
- NixlConnector for the prefill-to-decode KV hand-off (``kv_both`` on every node, as vLLM's
  P/D examples do; the sidecar's two hops decide who sends and who pulls), with a failed pull
  recomputed on the decode node rather than failed (``KV_TRANSFER_CONFIG``); vLLM's class
  extended by :mod:`kairos.nodeagent.vllm_plugin.split_connector`, whose decode side pulls only
  the prefix a split's prefill node computed (loaded by ``kv_connector_module_path``);
- prefix caching on (vLLM's default; ``prefix_caching=False`` turns it off), with the node's KV
  cache events published over ZMQ (``--kv-events-config``: a PUB socket and a replay socket, the
  wire format :mod:`kairos.common.kv_events` reads) so the dispatchers know which prefixes it
  holds, and ``--enable-prompt-tokens-details`` so each response's
  ``usage.prompt_tokens_details.cached_tokens`` says what the node found cached;
- on CPU (``device="cpu"``): an explicit KV-cache size, no thread pinning, one OpenMP thread,
  and NIXL over TCP with a CPU KV buffer.

This module only builds argv and env; :mod:`kairos.launcher.local_cluster` runs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventEndpoints, KvEventsConfig, advertised_endpoints

SCHEDULER_CLS = "kairos.nodeagent.vllm_plugin.scheduler.KairosScheduler"
# A KV pull that fails (a prefill node gone, a NIXL handshake over its fixed 5 s) makes the decode
# node compute the prompt itself: the request is served late instead of failed with a 500.
# The connector keeps vLLM's class name (vLLM checks for NIXL by name); the module path has vLLM
# load Kairos's subclass of it, which the split route needs on every decode node.
KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_connector_module_path": "kairos.nodeagent.vllm_plugin.split_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
_WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


@dataclass(frozen=True, slots=True)
class VllmNodeSpec:
    node_id: str
    role: Role
    python: str  # the interpreter of the environment vLLM (and kairos-gateway) is installed in
    model_dir: Path
    served_model_name: str
    port: int
    state_port: int  # KairosScheduler's loopback state server (the heartbeat publisher reads it)
    nixl_port: int  # VLLM_NIXL_SIDE_CHANNEL_PORT: distinct per node on one host
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int = 256 * 2**20
    device: str = "cpu"  # "cpu" adds the CPU recipe; "gpu" leaves vLLM's defaults
    load_format: str = "dummy"  # "auto" for real weights
    profile: str = ""  # latency profile the node enforces step budgets with
    step_log: str = ""  # JSONL path of the step recorder ("" = ring only, when record_steps)
    record_steps: bool = False
    workdir: Path | None = None  # vLLM's temp, IPC and cache files go here (CPU tests)
    host: str = "127.0.0.1"  # 0.0.0.0 (or the node's address) when other machines call it
    # vLLM's default. A deflected prefill's chunk schedule then covers the tokens after the
    # node's prefix hit (KairosScheduler). False: every prompt is computed in full.
    prefix_caching: bool = True
    # The node's KV cache events (ZMQ PUB, on every interface) and their replay (ROUTER, on
    # ``host``) ports; 0 = not published (the dispatchers then see no hits on this node).
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_events_replay_port and not self.kv_events_port:
            raise ConfigError(f"{self.node_id}: a KV events replay port needs kv_events_port")
        if self.kv_events_port and not self.prefix_caching:
            raise ConfigError(f"{self.node_id}: KV events need prefix caching (vLLM publishes none without it)")

    def argv(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",  # the `vllm` CLI looks for a distribution named vllm
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--load-format",
            self.load_format,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--scheduler-cls",
            SCHEDULER_CLS,
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config()),
            "--enable-prompt-tokens-details",
        ]
        if not self.prefix_caching:
            args.append("--no-enable-prefix-caching")
        elif (events := self.kv_events_config()) is not None:
            args += ["--kv-events-config", events.to_json()]
        if self.device == "cpu":
            args += ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return [*args, *self.extra_args]

    def kv_transfer_config(self) -> dict[str, str]:
        config = dict(KV_TRANSFER_CONFIG)
        if self.device == "cpu":
            config["kv_buffer_device"] = "cpu"
        return config

    def kv_events_config(self) -> KvEventsConfig | None:
        """vLLM's ``--kv-events-config`` (None: the node publishes no events). vLLM binds its PUB
        socket only to a wildcard endpoint (one naming a host, it connects to), so it listens on
        every interface; the replay socket binds on the node's listen address. The events carry
        prompt token ids: firewall both ports to the dispatchers."""
        if not self.kv_events_port or not self.prefix_caching:
            return None
        bind = "*" if self.host in _WILDCARD_HOSTS else self.host
        replay = _tcp(bind, self.kv_events_replay_port) if self.kv_events_replay_port else None
        return KvEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=_tcp("*", self.kv_events_port),
            replay_endpoint=replay,
            topic=KV_EVENTS_TOPIC,
        )

    def kv_event_endpoints(self, address: str | None = None) -> KvEventEndpoints | None:
        """Where a dispatcher subscribes to this node's KV events (None: it publishes none).
        ``address`` is the node's IP as the dispatchers reach it; by default the one it listens
        on, which must then not be a wildcard."""
        config = self.kv_events_config()
        if config is None:
            return None
        address = address or self.host
        if address in _WILDCARD_HOSTS:
            raise ConfigError(f"{self.node_id} listens on {self.host}: say the address dispatchers reach it at")
        return advertised_endpoints(config, address)

    def env(self) -> dict[str, str]:
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            "KAIROS_VLLM_STATE_PORT": str(self.state_port),
            "KAIROS_VLLM_NODE_ID": self.node_id,
            "KAIROS_VLLM_ROLE": str(self.role),
            "KAIROS_VLLM_PROFILE": self.profile,
            "KAIROS_VLLM_RECORD_STEPS": "1" if self.record_steps or self.step_log else "0",
            "KAIROS_VLLM_STEP_LOG": self.step_log,
        }
        if self.load_format == "dummy":
            env["HF_HUB_OFFLINE"] = "1"  # only the local config and tokenizer are read
        if self.device == "cpu":
            env |= {
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # else every server pins the same core
                "OMP_NUM_THREADS": "1",
                "UCX_TLS": "tcp,self,sm",
            }
        if self.workdir is not None:
            env |= {
                "TMPDIR": str(self.workdir),
                "VLLM_RPC_BASE_PATH": str(self.workdir),
                "VLLM_CACHE_ROOT": str(self.workdir / "cache"),
            }
        return env


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
