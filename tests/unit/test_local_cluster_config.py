"""LocalClusterConfig: the log level (one setting, checked once, for every process of the
cluster), the policy, and each node's KV events (its engine's flag and its publisher's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventEndpoints, KvEventsConfig
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig, NodeProcs, kv_events_config
from kairos.nodeagent.heartbeat import PublisherConfig


@pytest.mark.parametrize(("given", "level"), [("debug", "DEBUG"), ("Warning", "WARNING"), ("INFO", "INFO")])
def test_the_log_level_is_taken_in_any_case(given: str, level: str) -> None:
    assert LocalClusterConfig(log_level=given).log_level == level


def test_an_unknown_log_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="log_level must be one of"):
        LocalClusterConfig(log_level="loud")


def test_the_engines_get_the_cluster_log_level(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(log_level="debug"), tmp_path)
    cluster.model_dir = tmp_path / "model"
    argv = list(cluster.engine_process(NodeProcs("d0", "decode", 8101, 8201)).argv)
    assert argv[argv.index("--log-level") + 1] == "DEBUG"


@pytest.mark.parametrize("policy", ["kairos", "pd", "llmd:threshold=2048", "dynamo:mode=either", "aibrix"])
def test_the_gateway_policies_are_accepted(policy: str) -> None:
    assert LocalClusterConfig(policy=policy).policy == policy


@pytest.mark.parametrize(
    ("policy", "fragment"),
    [
        pytest.param("oracle", "needs the simulator's true state", id="oracle is simulator-only"),
        pytest.param("fifo", "unknown policy 'fifo'", id="unknown name"),
        pytest.param("dynamo:threshold=8", "bad parameter 'threshold=8'", id="unknown parameter"),
    ],
)
def test_a_policy_the_gateway_cannot_run_fails_before_any_process_starts(policy: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        LocalClusterConfig(policy=policy)


def test_a_started_cluster_refuses_a_second_start(tmp_path: Path) -> None:
    """`with LocalCluster(...).start() as c` starts it twice (the with statement starts it too):
    the second start must fail before it launches anything, not double every process."""
    from kairos.launcher.processes import ManagedProcess, ProcessError

    cluster = LocalCluster(LocalClusterConfig(), tmp_path)
    cluster.group.procs.append(ManagedProcess("redis", ["redis-server"], tmp_path / "redis.log"))
    with pytest.raises(ProcessError, match="already started"):
        cluster.start()
    assert len(cluster.group.procs) == 1 and cluster.redis is None


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_an_engine_publishes_kv_events_where_its_publisher_says(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(), tmp_path)
    cluster.model_dir = tmp_path / "model"
    node = NodeProcs("d0", "decode", 8101, 8201, kv_events=kv_events_config(5557, 5558))
    engine = flag(list(cluster.engine_process(node).argv), "--kv-events-config")
    beat = cluster.publisher_argv(node)
    assert engine is not None and flag(beat, "--kv-events-config") == engine  # the same JSON, verbatim
    config = KvEventsConfig.from_json(engine)
    assert config.publishes and (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    publisher = PublisherConfig("d0", "decode", node.url, node.sidecar_url, kv_events_config=engine)
    advertised = KvEventEndpoints("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", KV_EVENTS_TOPIC)
    assert publisher.kv_event_endpoints() == advertised


def test_a_node_without_kv_events_neither_publishes_nor_advertises(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(kv_events=False), tmp_path)
    cluster.model_dir = tmp_path / "model"
    node = NodeProcs("p0", "prefill", 8001, None)
    assert "--kv-events-config" not in cluster.engine_process(node).argv
    assert "--kv-events-config" not in cluster.publisher_argv(node)
