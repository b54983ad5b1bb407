"""The sidecar's settings (:class:`SidecarConfig`) and the ``host:port`` form every host in them, and in a
routing header, must have."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kairos.common import defaults
from kairos.common.config import ConfigSource, setting
from kairos.common.errors import ConfigError
from kairos.common.redis_client import check_redis_url
from kairos.core.slo import SloClass, classes_setting

# host:port, nothing else; underscores allowed for docker-compose service names.
_HOSTPORT = re.compile(r"(?:\[[0-9a-f:.]+\]|[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?):([0-9]{1,5})")


def normalize_hostport(value: str) -> str | None:
    """``value`` as a canonical lowercase ``host:port``, or None if it is anything else (a
    scheme, a path, user info, a bad port): a header must not smuggle a URL into hop 1."""
    text = value.strip().lower()
    m = _HOSTPORT.fullmatch(text)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        return None
    return text


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Settings of one decode node's sidecar."""

    host: str = setting("127.0.0.1", help="listen address (0.0.0.0 to take Envoy's traffic from other machines)")
    port: int = setting(8201, help="listen port (0: any free port)")
    local_vllm: str = setting("127.0.0.1:8101", help="host:port of this decode node's vLLM OpenAI server")
    # The live cluster view adds more at run time.
    allowed_prefill_hosts: tuple[str, ...] = setting(
        (), help="host:port of prefill vLLMs hop 1 may always call, comma-separated", flags=("--allow-prefill",)
    )
    hop1_connect_timeout_s: float = setting(1.0, help="TCP connect to a prefill node")
    hop1_timeout_s: float = setting(30.0, help="all of hop 1 (connect, prefill queue and execution, reply); then 504")
    # Not a total: a long generation may stream for minutes.
    hop2_timeout_s: float = setting(
        300.0,
        help="the local vLLM: bound on connect, on waiting for response headers and on the silence between two "
        "body chunks",
    )
    max_body_bytes: int = setting(
        defaults.MAX_REQUEST_BODY_BYTES, help="larger request bodies are answered 413 before they are parsed"
    )
    redis_url: str = setting(
        "", help="redis://host:port/db for the TTFT feedback stream (empty: no feedback, no Redis)", flags=("--redis",)
    )
    # kairos.nodeagent.fanout sends them one request each.
    gateway: str = setting(
        "", help="host:port of the gateway (Envoy) a batch's prompts are sent back through; empty: a batch gets 502"
    )
    # The dispatcher's, as kairos.core.slo.parse_classes reads them.
    slo_classes: tuple[SloClass, ...] = classes_setting()

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host must not be empty")
        if self.redis_url:
            check_redis_url("redis_url", self.redis_url)
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        local = normalize_hostport(self.local_vllm)
        if local is None:
            raise ConfigError(f"local_vllm must be host:port, got {self.local_vllm!r}")
        object.__setattr__(self, "local_vllm", local)
        allowed = []
        for entry in self.allowed_prefill_hosts:
            norm = normalize_hostport(entry)
            if norm is None:
                raise ConfigError(f"allowed_prefill_hosts: expected host:port, got {entry!r}")
            allowed.append(norm)
        object.__setattr__(self, "allowed_prefill_hosts", tuple(dict.fromkeys(allowed)))
        for name in ("hop1_connect_timeout_s", "hop1_timeout_s", "hop2_timeout_s"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ConfigError(f"{name} must be finite and > 0, got {value}")
        if self.hop1_connect_timeout_s > self.hop1_timeout_s:
            raise ConfigError(
                f"hop1_connect_timeout_s ({self.hop1_connect_timeout_s}) must not exceed "
                f"hop1_timeout_s ({self.hop1_timeout_s})"
            )
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.gateway:
            gateway = normalize_hostport(self.gateway)
            if gateway is None:
                raise ConfigError(f"gateway must be host:port, got {self.gateway!r}")
            object.__setattr__(self, "gateway", gateway)


SOURCE = ConfigSource(SidecarConfig, section="sidecar", env_prefix="KAIROS_SIDECAR_", module="kairos.nodeagent.sidecar")
