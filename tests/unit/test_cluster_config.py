"""The cluster view's settings: checks at construction, and every one reachable from the
dispatcher's YAML with the view's own defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kairos.common.config import load_config
from kairos.common.errors import ConfigError
from kairos.core.view import ClusterTracker
from kairos.extproc.cluster import ClusterViewConfig, RedisClusterView, redis_error_counter
from kairos.extproc.config import DispatcherConfig
from kairos.extproc.membership import MembershipConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"poll_s": 0.0}, "poll_s must be > 0"),
        (
            {"poll_s": 0.4, "membership": MembershipConfig(stale_after_s=0.35)},
            "stale_after_s=0.35 must exceed poll_s=0.4",
        ),
        ({"scan_every_polls": 0}, "scan_every_polls must be >= 1"),
        ({"redis_url": "127.0.0.1:6379"}, "redis_url: expected"),
        ({"reservation_ttl_s": 0.0}, "reservation_ttl_s must be 0.001 (1 ms) to 10"),
        ({"reservation_ttl_s": 10.5}, "reservation_ttl_s must be 0.001 (1 ms) to 10"),
        ({"redis_timeout_s": 0.0}, "redis_timeout_s must be > 0"),
    ],
)
def test_invalid_view_configs_are_rejected(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClusterViewConfig(**changes)
    assert message in info.value.message


def test_reservation_ttl_in_ms() -> None:
    assert ClusterViewConfig().reservation_ttl_ms == 300
    assert ClusterViewConfig(reservation_ttl_s=0.001).reservation_ttl_ms == 1


def test_views_sharing_a_registry_share_one_counter() -> None:
    registry = CollectorRegistry()
    a = RedisClusterView(ClusterViewConfig(), registry=registry)
    b = RedisClusterView(ClusterViewConfig(), ClusterTracker(), registry=registry)
    assert a._errors is b._errors is redis_error_counter(registry)


def test_the_dispatchers_defaults_are_the_views() -> None:
    assert DispatcherConfig(model_dir="m").view == ClusterViewConfig()


def test_every_view_setting_is_reachable_from_the_dispatchers_yaml(tmp_path: Path) -> None:
    yaml_file = tmp_path / "kairos.yaml"
    yaml_file.write_text(
        "dispatcher:\n"
        "  model_dir: m\n"
        "  redis_url: redis://10.0.0.9:6380/1\n"
        "  poll_s: 0.02\n"
        "  scan_every_polls: 7\n"
        "  redis_timeout_s: 0.5\n"
        "  reservation_ttl_s: 0.4\n"
        "  stale_after_s: 0.25\n"
        "  recovery_grace_s: 1.5\n"
        "  forget_malformed_after_s: 2.5\n"
        "  last_resort_s: 12\n"
        "  dispatch_grace_s: 0.2\n"
        "  fallback_prefill: p0=10.0.0.1:8001\n"
        "  fallback_decode: d0=10.0.0.2:8201\n"
    )
    config = load_config(DispatcherConfig, yaml_file, section="dispatcher")
    assert config.view == ClusterViewConfig(
        redis_url="redis://10.0.0.9:6380/1",
        poll_s=0.02,
        scan_every_polls=7,
        redis_timeout_s=0.5,
        reservation_ttl_s=0.4,
        membership=MembershipConfig(
            stale_after_s=0.25,
            recovery_grace_s=1.5,
            forget_malformed_after_s=2.5,
            last_resort_s=12.0,
            fallback_prefill=("p0=10.0.0.1:8001",),
            fallback_decode=("d0=10.0.0.2:8201",),
        ),
    )
    assert config.dispatch_grace_s == 0.2
    assert config.decider.stale_after_s == 0.25  # one setting: the decider and the view agree on staleness


def test_a_bad_view_setting_fails_at_start_up() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DispatcherConfig, overrides={"model_dir": "m", "poll_s": 0.1, "stale_after_s": 0.05})
    assert "stale_after_s=0.05 must exceed poll_s=0.1" in info.value.message
