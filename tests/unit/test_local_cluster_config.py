"""LocalClusterConfig: the log level (one setting, checked once, for every process of the
cluster), the policy, and each node's KV events (its engine's flag and its publisher's)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from kairos.common.config import ConfigSource
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventEndpoints, KvEventsConfig
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig, NodeProcs, cluster_config, kv_events_config
from kairos.launcher.processes import ManagedProcess
from kairos.launcher.redis_setup import RedisSetup
from kairos.nodeagent.heartbeat import SOURCE as HEARTBEAT
from kairos.nodeagent.heartbeat import PublisherConfig
from kairos.nodeagent.sidecar.config import SOURCE as SIDECAR
from kairos.sim.emulated_vllm.config import SOURCE as EMULATED_NODE

T = TypeVar("T")


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
    assert cluster_config(policy=policy).policy == policy


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
        cluster_config(policy=policy)


def test_a_started_cluster_refuses_a_second_start(tmp_path: Path) -> None:
    """`with LocalCluster(...).start() as c` starts it twice (the with statement starts it too):
    the second start must fail before it launches anything, not double every process."""
    from kairos.launcher.processes import ManagedProcess, ProcessError

    cluster = LocalCluster(LocalClusterConfig(), tmp_path)
    cluster.group.procs.append(ManagedProcess("redis", ["redis-server"], tmp_path / "redis.log"))
    with pytest.raises(ProcessError, match="already started"):
        cluster.start()
    assert len(cluster.group.procs) == 1 and cluster.redis is None


def child_config(source: ConfigSource[T], argv: Sequence[str]) -> T:
    """What a child the cluster starts reads: its YAML file, named on its command line."""
    return source.load(argv[list(argv).index("--config") + 1], environ={})


def test_an_engine_publishes_kv_events_where_its_publisher_says(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(), tmp_path)
    cluster.model_dir = tmp_path / "model"
    node = NodeProcs("d0", "decode", 8101, 8201, kv_events=kv_events_config(5557, 5558))
    engine = child_config(EMULATED_NODE, cluster.engine_process(node).argv).kv_events_config
    beat = child_config(HEARTBEAT, cluster.publisher_argv(node))
    assert engine is not None and beat.kv_events_config == engine  # the same JSON, verbatim
    config = KvEventsConfig.from_json(engine)
    assert config.publishes and (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    publisher = PublisherConfig("d0", "decode", node.url, node.sidecar_url, kv_events_config=engine)
    advertised = KvEventEndpoints("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", KV_EVENTS_TOPIC)
    assert publisher.kv_event_endpoints() == advertised


def test_a_node_without_kv_events_neither_publishes_nor_advertises(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(kv_events=False), tmp_path)
    cluster.model_dir = tmp_path / "model"
    node = NodeProcs("p0", "prefill", 8001, None)
    assert child_config(EMULATED_NODE, cluster.engine_process(node).argv).kv_events_config is None
    assert child_config(HEARTBEAT, cluster.publisher_argv(node)).kv_events_config == ""


def test_every_child_reads_the_settings_the_cluster_gives_it(tmp_path: Path) -> None:
    """One setting by name reaches each process that has it, through its YAML file: the decider's
    and the admission's to the dispatchers, the SLO classes to the sidecars, the engine's knobs to
    the nodes; the Redis URL (a password) never, their environment gives it."""
    config = cluster_config(
        alpha=1.3,
        deflect_gate_share=None,  # a value, not "not given": the gate off
        admission_max_wait_s=0.5,
        hop1_timeout_s=7,
        slo_classes="gold=500/40",
        time_scale=20,
    )
    cluster = LocalCluster(config, tmp_path)
    cluster.model_dir = tmp_path / "model"
    cluster.nodes = [NodeProcs("p0", "prefill", 8001, None), NodeProcs("d0", "decode", 8101, 8201)]
    cluster.redis_setup = RedisSetup.create(tmp_path / "redis", 6399, ["p0", "d0"])
    cluster.dispatcher_ports, cluster.dispatcher_metrics_ports, cluster.gateway_port = [9000], [9100], 8000
    started: list[ManagedProcess] = []
    cluster.group.start = lambda proc, timeout_s: started.append(proc) or proc  # type: ignore[method-assign]
    cluster.start_dispatcher(0)
    cluster.start_agents(cluster.nodes[1])
    dispatcher = child_config(DISPATCHER, started[0].argv)
    assert (dispatcher.decider.alpha, dispatcher.admission_limits.max_wait_s, dispatcher.port) == (1.3, 0.5, 9000)
    assert dispatcher.view.membership.admit_nodes == "listed" and dispatcher.decider.deflect_gate_share is None
    assert [k.name for k in dispatcher.requests.slo_classes] == ["gold"]  # one setting: the sidecars' classes too
    assert dispatcher.view.membership.fallback_decode == ("d0=127.0.0.1:8101+127.0.0.1:8201",)
    sidecar = child_config(SIDECAR, started[1].argv)
    assert (sidecar.hop1_timeout_s, [k.name for k in sidecar.slo_classes]) == (7.0, ["gold"])
    assert (sidecar.local_vllm, sidecar.allowed_prefill_hosts) == ("127.0.0.1:8101", ("127.0.0.1:8001",))
    engine = child_config(EMULATED_NODE, cluster.engine_process(cluster.nodes[1]).argv)
    assert (engine.time_scale, engine.max_step_tokens, engine.port) == (20.0, config.decode_step_tokens, 8101)
    for proc in started:
        assert "redis" not in Path(proc.argv[proc.argv.index("--config") + 1]).read_text()
        assert any(k.endswith("REDIS_URL") for k in proc.env or {})
