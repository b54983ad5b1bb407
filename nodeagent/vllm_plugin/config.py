"""Settings of the Kairos plugins inside a vLLM server.

vLLM's command line cannot carry our flags, so the scheduler reads them from the environment
(``KAIROS_VLLM_*``) over an optional YAML file named by ``KAIROS_VLLM_CONFIG`` (section
``vllm``), over these defaults. Everything is off by default except the schedule itself: a
plain vLLM with the plugin installed behaves like vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kairos.common.config import load_config
from kairos.common.errors import ConfigError

ENV_PREFIX = "KAIROS_VLLM_"
CONFIG_FILE_ENV = "KAIROS_VLLM_CONFIG"


@dataclass(frozen=True, slots=True)
class PluginConfig:
    # The local channel to the heartbeat publisher: GET http://state_host:state_port/kairos/state
    # (and /kairos/steps when the step recorder is on). 0 = no server.
    state_host: str = "127.0.0.1"
    state_port: int = 0
    state_refresh_s: float = 0.02  # newest snapshot at most this old while the engine steps
    # Step recorder (off by default): keep the last ``step_ring`` steps for /kairos/steps and,
    # when ``step_log`` is a path, append every step to it as JSONL.
    record_steps: bool = False
    step_log: str = ""
    step_ring: int = 10_000
    # Latency profile (packaged name or JSON path) the node uses to hold a deflected prefill's
    # chunks within the step budget the dispatcher sent; "" = the budget cannot be enforced.
    profile: str = ""
    node_id: str = ""  # copied into step records, so records from several nodes stay apart
    # The node's role: a decode node (or "", not said) with a profile measures its step times
    # against the profile and reports its step calibration in the engine state.
    role: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.state_port < 65536:
            raise ConfigError(f"{ENV_PREFIX}STATE_PORT must be a port number or 0, got {self.state_port}")
        if self.state_refresh_s <= 0:
            raise ConfigError(f"{ENV_PREFIX}STATE_REFRESH_S must be > 0, got {self.state_refresh_s}")
        if self.role not in ("", "prefill", "decode"):
            raise ConfigError(f"{ENV_PREFIX}ROLE must be 'prefill', 'decode' or empty, got {self.role!r}")
        if self.step_ring < 1:
            raise ConfigError(f"{ENV_PREFIX}STEP_RING must be >= 1, got {self.step_ring}")

    @property
    def recorder_on(self) -> bool:
        return self.record_steps or bool(self.step_log)

    @classmethod
    def from_env(cls) -> PluginConfig:
        path = os.environ.get(CONFIG_FILE_ENV) or None
        return load_config(cls, Path(path) if path else None, section="vllm", env_prefix=ENV_PREFIX)
