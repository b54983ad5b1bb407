"""Each default is written once (kairos.common.defaults): every config, the compose files and
the README agree with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kairos.common import defaults
from kairos.common.config import config_mapping, settings_of
from kairos.common.contracts import HEARTBEAT_PERIOD_S
from kairos.core.algorithm import DeciderConfig
from kairos.core.latency import DEFAULT_PROFILE
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.extproc.config import DispatcherConfig
from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config
from kairos.launcher.local_cluster import LocalClusterConfig
from kairos.launcher.replay import ReplayConfig
from kairos.sim.experiment import SimSettings
from kairos.sim.simulator import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]

# The paper's values (§6.1): a change here is a change of the method, not a refactor.
PAPER = {
    "BETA": 1.0,
    "TBT_SLO_S": 0.070,
    "TTFT_SLO_S": 4.0,
    "PAPER_CHUNK_CANDIDATES": (2048, 1024, 512, 256, 128),
}


# Where the defaults leave the paper, each measured (docs/design/never-worse.md, replicas.md and
# chunk-sizes.md): alpha 1.3 -> 1 (kairos:alpha=1.3 is the paper's), one deflection in flight per
# node -> no limit, the deflection gate the paper does not have, and four step sizes per octave.
DEPARTURES = {
    "ALPHA": 1.0,
    "MAX_PENDING_DEFLECTIONS": None,
    "DEFLECT_GATE_SHARE": 0.25,
    "CHUNK_CANDIDATES": (2048, 1792, 1536, 1280, 1024, 896, 768, 640, 512, 448, 384, 320, 256, 224, 192, 160, 128),
}


def test_the_papers_values() -> None:
    assert {name: getattr(defaults, name) for name in PAPER} == PAPER
    assert {name: getattr(defaults, name) for name in DEPARTURES} == DEPARTURES
    assert HEARTBEAT_PERIOD_S == 0.1


def fields(obj: Any) -> dict[str, Any]:
    """A config's settings by name, its parts' included (a composite's own properties too)."""
    out: dict[str, Any] = {}
    for name, s in settings_of(type(obj)).items():
        value = obj
        for step in s.paths[0]:
            value = getattr(value, step)
        out[name] = value
    return out | {name: getattr(obj, name) for name in ("profile", "max_model_len") if hasattr(obj, name)}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            DeciderConfig(),
            {
                "alpha": defaults.ALPHA,
                "beta": defaults.BETA,
                "tbt_slo_s": defaults.TBT_SLO_S,
                "ttft_slo_s": defaults.TTFT_SLO_S,
                "chunk_candidates": defaults.CHUNK_CANDIDATES,
                "stale_after_s": defaults.STALE_AFTER_S,
            },
        ),
        (
            DispatcherConfig(model_dir="m"),
            {
                "alpha": defaults.ALPHA,
                "beta": defaults.BETA,
                "tbt_slo_s": defaults.TBT_SLO_S,
                "ttft_slo_s": defaults.TTFT_SLO_S,
                "stale_after_s": defaults.STALE_AFTER_S,
                "profile": defaults.PROFILE,
                "max_model_len": defaults.MAX_MODEL_LEN,
            },
        ),
        (
            LocalClusterConfig(),
            {
                "alpha": defaults.ALPHA,
                "beta": defaults.BETA,
                "tbt_slo_s": defaults.TBT_SLO_S,
                "ttft_slo_s": defaults.TTFT_SLO_S,
                "profile": defaults.PROFILE,
                "max_model_len": defaults.MAX_MODEL_LEN,
                "kv_capacity_tokens": defaults.KV_CAPACITY_TOKENS,
                "prefill_step_tokens": defaults.PREFILL_STEP_TOKENS,
                "decode_step_tokens": defaults.DECODE_STEP_TOKENS,
                "heartbeat_period_s": HEARTBEAT_PERIOD_S,
            },
        ),
        (ReplayConfig(), {"ttft_slo_s": defaults.TTFT_SLO_S, "tbt_slo_ms": defaults.TBT_SLO_S * 1e3}),
        (
            SimSettings(),
            {
                "tbt_slo_s": defaults.TBT_SLO_S,
                "ttft_slo_s": defaults.TTFT_SLO_S,
                "stale_after_s": defaults.STALE_AFTER_S,
                "profile": defaults.PROFILE,
                "kv_capacity_tokens": defaults.KV_CAPACITY_TOKENS,
                "heartbeat_s": HEARTBEAT_PERIOD_S,
                "prefill_step_tokens": defaults.PREFILL_STEP_TOKENS,
                "decode_step_tokens": defaults.DECODE_STEP_TOKENS,
                "chunk_candidates": defaults.CHUNK_CANDIDATES,
            },
        ),
        (
            ClusterConfig(),
            {
                "kv_capacity_tokens": defaults.KV_CAPACITY_TOKENS,
                "heartbeat_s": HEARTBEAT_PERIOD_S,
                "prefill_step_tokens": defaults.PREFILL_STEP_TOKENS,
                "decode_step_tokens": defaults.DECODE_STEP_TOKENS,
            },
        ),
    ],
    ids=lambda x: type(x).__name__ if dataclasses.is_dataclass(x) else "",
)
def test_every_config_defaults_to_the_shared_values(config: Any, expected: dict[str, Any]) -> None:
    got = fields(config)
    assert {k: got[k] for k in expected} == expected
    assert DEFAULT_PROFILE == defaults.PROFILE


@pytest.mark.parametrize("compose_files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]])
@pytest.mark.parametrize("dispatcher", ["dispatcher0", "dispatcher1"])
def test_the_compose_dispatcher_runs_the_shared_defaults(compose_files: list[str], dispatcher: str) -> None:
    """Its settings, read from its environment as the dispatcher reads them (every variable one of
    its settings: a misspelt one would leave a default in place unseen)."""
    env: dict[str, str] = {}
    for name in compose_files:  # compose merges an override's environment into the base's
        env |= yaml.safe_load((ROOT / "compose" / name).read_text())["services"][dispatcher].get("environment", {})
    known = {DISPATCHER.env_var(name) for name in settings_of(DispatcherConfig)}
    assert set(env) <= known, f"not dispatcher settings: {sorted(set(env) - known)}"
    password = re.compile(r"\$\{KAIROS_REDIS_PASSWORD:\?[^}]*\}")  # compose/.env's
    config = DISPATCHER.load(environ={var: password.sub("pw", value) for var, value in env.items()})
    got = config_mapping(config, changed_only=False)
    assert {name: got[name] for name in ("alpha", "beta", "tbt_slo_s", "ttft_slo_s", "max_model_len", "profile")} == {
        "alpha": defaults.ALPHA,
        "beta": defaults.BETA,
        "tbt_slo_s": defaults.TBT_SLO_S,
        "ttft_slo_s": defaults.TTFT_SLO_S,
        "max_model_len": defaults.MAX_MODEL_LEN,
        "profile": defaults.PROFILE,
    }


def test_the_readme_states_the_shared_defaults() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"alpha {defaults.ALPHA:g}" in readme
    assert f"tau {defaults.TBT_SLO_S * 1e3:g} ms" in readme
    assert f"TTFT SLO {defaults.TTFT_SLO_S:g} s" in readme


def test_envoy_closes_an_idle_sidecar_connection_before_the_sidecar_does() -> None:
    rendered = yaml.safe_load(render_envoy_config(EnvoySettings(sidecars=("127.0.0.1:8201",))))
    (cluster,) = (c for c in rendered["static_resources"]["clusters"] if c["name"] == "decode_sidecars")
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    idle = options["common_http_protocol_options"]["idle_timeout"]
    assert idle == f"{defaults.GATEWAY_SIDECAR_IDLE_S:g}s"
    assert 0 < defaults.GATEWAY_SIDECAR_IDLE_S < defaults.SIDECAR_KEEP_ALIVE_S
    for compose_envoy in ("envoy.yaml", "envoy.loopback.yaml"):
        assert f"idle_timeout: {idle}" in (ROOT / "compose" / compose_envoy).read_text()
