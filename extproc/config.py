"""The dispatcher's settings: :class:`DispatcherConfig`, its parts nested whole.

Its flags (``kairos dispatcher --help``), ``KAIROS_DISPATCHER_*`` variables and the YAML section
``dispatcher`` are derived from it (:mod:`kairos.common.config`); ``kairos up`` nests it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kairos.common import defaults
from kairos.common.config import ConfigSource, part, setting
from kairos.common.errors import ConfigError
from kairos.core.admission import AdmissionLimits
from kairos.core.algorithm import DeciderConfig
from kairos.core.latency import DEFAULT_PROFILE, LatencyModels
from kairos.core.policies import (
    NoPrefillPoolPolicy,
    create_policy,
    parse_policy_spec,
    policy_synopsis,
    validate_gateway_policy,
)
from kairos.core.policies.kairos import DECIDER_FIELDS
from kairos.extproc.cluster import ClusterViewConfig
from kairos.extproc.dispatcher import DispatchSettings, Policies
from kairos.extproc.feedback import DEFAULT_WINDOW


@dataclass(frozen=True)
class DispatcherConfig:
    """Everything the dispatcher process needs."""

    host: str = setting("127.0.0.1", help="listen address of the ext_proc gRPC service")
    port: int = setting(9000, help="ext_proc gRPC port (0: any free port)")
    metrics_port: int = setting(9100, help="port of Prometheus /metrics, /health and /nodes (0: off)")
    # Checked when the dispatcher starts (kairos up nests this config and gives each replica its own).
    model_dir: str = setting("", help="the served model's tokenizer directory (tokenizer.json); required")
    profile: str = setting(DEFAULT_PROFILE, help="latency profile: a packaged name or a JSON path")
    # Packaged profiles never change; SIGHUP re-reads a file at once.
    profile_reload_s: float = setting(1.0, help="check a profile file for changes this often (0: SIGHUP only)")
    ttft_feedback_window: int = setting(
        DEFAULT_WINDOW, help="samples per path in the rolling MAPE of the sidecars' TTFT feedback (0: do not read it)"
    )
    policy: str = setting("kairos", help=lambda: f"the routing policy: {policy_synopsis(gateway=True)}")
    # One poll of delay on our side plus the sidecar hop.
    dispatch_grace_s: float = setting(
        0.1, help="a dispatch stays in the view's overlay until a heartbeat taken this long after it arrives"
    )
    # Subscribed only under a prefix-aware policy.
    prefix_index_capacity_blocks: int = setting(
        defaults.PREFIX_INDEX_CAPACITY_BLOCKS,
        help="KV blocks indexed per node from its KV cache events (the oldest dropped past it)",
    )
    kv_events_replay_timeout_s: float = setting(
        defaults.KV_EVENTS_REPLAY_TIMEOUT_S,
        help="a node's KV event replay that takes longer resets its prefix index instead",
    )
    # Off decides every request however many are in flight or open (the gateway then holds what
    # Envoy's limits let in); on also sheds when the dispatcher is too busy to decide in time.
    admission: bool = setting(True, help="on: a bounded in-flight budget, 429 past it; off: decide every request")
    admission_limits: AdmissionLimits = part(AdmissionLimits, help="the admission budget", prefix="admission_")
    view: ClusterViewConfig = part(ClusterViewConfig, help="the cluster view from Redis")
    decider: DeciderConfig = part(DeciderConfig, help="Algorithm 1")
    requests: DispatchSettings = part(DispatchSettings, help="request-level knobs")

    def __post_init__(self) -> None:
        validate_gateway_policy(self.policy)
        name, params = parse_policy_spec(self.policy)
        if name == "kairos" and (given := [p for p in params if p in DECIDER_FIELDS]):
            settings = ", ".join(f"{p}= as {DECIDER_FIELDS[p]}" for p in given)
            raise ConfigError(
                f"policy {self.policy!r}: the dispatcher takes the decider's knobs as its own settings, not in the "
                f"policy spec: set {settings} (a flag, a KAIROS_DISPATCHER_* variable or a YAML key)"
            )
        if not 0 <= self.profile_reload_s < float("inf"):
            raise ConfigError(f"profile_reload_s must be >= 0 (0 = off), got {self.profile_reload_s}")
        if self.ttft_feedback_window < 0:
            raise ConfigError(f"ttft_feedback_window must be >= 0 (0 = off), got {self.ttft_feedback_window}")
        if not self.dispatch_grace_s >= 0:
            raise ConfigError(f"dispatch_grace_s must be >= 0, got {self.dispatch_grace_s}")
        if self.prefix_index_capacity_blocks < 1:
            raise ConfigError(f"prefix_index_capacity_blocks must be >= 1, got {self.prefix_index_capacity_blocks}")
        if not self.kv_events_replay_timeout_s > 0:
            raise ConfigError(f"kv_events_replay_timeout_s must be > 0, got {self.kv_events_replay_timeout_s}")
        if self.decider.stale_after_s != self.view.membership.stale_after_s:  # one setting sets both
            object.__setattr__(
                self, "decider", dataclasses.replace(self.decider, stale_after_s=self.view.membership.stale_after_s)
            )

    def check_serving(self) -> None:
        """What only a running dispatcher needs (a launcher's nested copy may leave it unset)."""
        if not self.model_dir:
            raise ConfigError("model_dir is required: the directory with the served model's tokenizer.json")

    def policies(self, models: LatencyModels) -> Policies:
        """The routing policies on ``models`` (rebuilt whole on every profile reload)."""
        return Policies(
            create_policy(self.policy, models, self.decider),
            create_policy("pd", models, self.decider),
            NoPrefillPoolPolicy(models, self.decider),
        )


SOURCE = ConfigSource(DispatcherConfig, section="dispatcher", env_prefix="KAIROS_DISPATCHER_", module="kairos.extproc")
