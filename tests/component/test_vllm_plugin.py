"""The vLLM plugins' vLLM-free parts: the state snapshot, the step recorder, the loopback state
server and the node command line. (Schedule parsing is the contracts'; tests/unit/test_contracts.py
and tests/component/test_schedule_parity.py. The scheduler itself runs inside real vLLM in
tests/integration.)"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest

from kairos.common import defaults
from kairos.common.contracts import (
    STEP_BUDGET_OVERRUNS_METRIC,
    EngineStep,
    StepChunk,
    encode_engine_state,
    parse_engine_state,
    parse_step_record,
    parse_steps_page,
)
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventEndpoints, KvEventsConfig
from kairos.core.latency import largest_chunk_within, load_profile
from kairos.launcher.local_cluster import LocalClusterConfig
from kairos.launcher.vllm_cluster import VllmBackend, VllmCluster
from kairos.launcher.vllm_node import SCHEDULER_CLS, VllmNodeSpec
from kairos.nodeagent.heartbeat import SOURCE as HEARTBEAT
from kairos.nodeagent.heartbeat import PublisherConfig
from kairos.nodeagent.vllm_plugin.config import PluginConfig
from kairos.nodeagent.vllm_plugin.engine_state import PendingPrefill, RequestTpots, build_state
from kairos.nodeagent.vllm_plugin.recorder import StepRecorder
from kairos.nodeagent.vllm_plugin.state_server import StateServer


# -- step budget guard ---------------------------------------------------------------------------
def test_largest_chunk_within_is_the_largest_that_fits() -> None:
    models = load_profile()
    b, k, cached = 24, 24 * 3569, 2048
    limit = models.mixed_step_s(b + 700, cached, b, k)
    n = largest_chunk_within(models, 2048, cached, b, k, limit)
    assert models.mixed_step_s(b + n, cached, b, k) <= limit < models.mixed_step_s(b + n + 1, cached, b, k)
    assert largest_chunk_within(models, 300, cached, b, k, limit) == 300  # already fits: unchanged
    assert largest_chunk_within(models, 2048, cached, b, k, models.decode_step_s(b, k)) == 0  # nothing fits


# -- state snapshot -------------------------------------------------------------------------------
def test_state_snapshot_is_what_the_publisher_reads() -> None:
    state = build_state(
        decode_tokens=3,
        kv_tokens=4100,
        kv_capacity_tokens=131072,
        prefills=[
            PendingPrefill(500, False),
            PendingPrefill(0, False),
            PendingPrefill(900, True),
            PendingPrefill(7, False),
        ],
        max_step_tokens=2048,
        model="tiny",
        running_requests=4,
        waiting_requests=2,
        kv_usage=0.0312,
        step_calibration=1.25,
    )
    parsed = parse_engine_state(encode_engine_state(state).encode())
    assert parsed == state and parsed.step_calibration == 1.25
    assert parsed.decode_tokens == 3 and parsed.kv_tokens == 4100 and parsed.kv_capacity_tokens == 131072
    assert parsed.queued_prefill_tokens == (500, 7)  # FIFO, finished prefills left out
    assert parsed.scheduled_prefill_tokens == (900,)
    assert (parsed.running_requests, parsed.waiting_requests, parsed.kv_usage) == (4, 2, 0.0312)
    assert parsed.as_of is not None


def test_request_tpots_hold_chunks_to_the_decodes_beside_them_and_report_the_tightest() -> None:
    """The scheduler's TPOT bookkeeping: a request without kairos_tpot_slo_ms counts as the
    cluster's default; a batch chunk's budget shrinks beside an interactive decode only."""
    tpots = RequestTpots()
    assert tpots.tightest_s() is None  # none in flight: the state leaves the field out
    tpots.add("batch", 0.150)
    tpots.add("interactive", 0.060)
    tpots.add("plain", None)
    assert tpots.tightest_s() == 0.060
    assert tpots.tightest_s(["batch", "plain"]) == defaults.TBT_SLO_S
    assert tpots.tightest_s(["batch"]) == 0.150
    assert tpots.chunk_budget_s("batch", 0.150, tpots.tightest_s(["batch"])) == 0.150
    assert tpots.chunk_budget_s("batch", 0.150, tpots.tightest_s(["interactive"])) == pytest.approx(0.060)
    assert tpots.chunk_budget_s("interactive", 0.060, tpots.tightest_s(["batch"])) == 0.060  # never looser
    assert tpots.chunk_budget_s("batch", None, 0.060) is None  # no budget carried: none held
    assert tpots.chunk_budget_s("batch", 0.150, None) == 0.150  # no decode running
    tpots.keep_only({"batch", "plain"})  # "interactive" finished
    assert set(tpots.own_s) == {"batch", "plain"} and tpots.tightest_s() == defaults.TBT_SLO_S
    state = build_state(
        decode_tokens=2,
        kv_tokens=100,
        kv_capacity_tokens=1000,
        prefills=[],
        max_step_tokens=512,
        model="tiny",
        running_requests=2,
        waiting_requests=0,
        kv_usage=0.1,
        kv_pulls=[],
        tpot_slo_s=tpots.tightest_s(),
    )
    parsed = parse_engine_state(encode_engine_state(state).encode())
    assert parsed == state and parsed.tpot_slo_ms == pytest.approx(defaults.TBT_SLO_S * 1e3)
    idle = msgspec.structs.replace(state, tpot_slo_ms=None)
    assert "tpot_slo_ms" not in json.loads(encode_engine_state(idle))


# -- step recorder and state server --------------------------------------------------------------
def _record(rec: StepRecorder, index: int) -> None:
    rec.record(EngineStep(index, 100.0 + index, 0.01, 2, 300, (StepChunk("r1", 128, 128 * index),)))


def test_step_recorder_keeps_a_ring_and_appends_jsonl(tmp_path: Path) -> None:
    log = tmp_path / "sub" / "steps.jsonl"
    rec = StepRecorder(ring=3, path=log, node="d0")
    for i in range(5):
        _record(rec, i)
    assert [r["index"] for r in rec.since(0)] == [2, 3, 4]
    assert [r["index"] for r in rec.since(4)] == [4]
    assert rec.next_index == 5
    rec.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2, 3, 4]
    assert lines[1] == {
        "index": 1,
        "start": 101.0,
        "duration": 0.01,
        "decode_tokens": 2,
        "kv_tokens": 300,
        "chunks": [{"request_id": "r1", "tokens": 128, "cached": 128}],
        "node": "d0",
    }
    assert parse_step_record(lines[1]) == EngineStep(1, 101.0, 0.01, 2, 300, (StepChunk("r1", 128, 128),), "d0")


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_state_server_serves_the_newest_snapshot_and_steps() -> None:
    rec = StepRecorder(ring=10, node="d0")
    server = StateServer("127.0.0.1", 0, rec)
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, body = _get(f"{base}/kairos/state")
        assert status == 503 and "not ready" in body["error"]["message"]
        server.publish(b'{"decode_tokens": 1}')
        server.publish(b'{"decode_tokens": 2}')
        assert _get(f"{base}/kairos/state") == (200, {"decode_tokens": 2})
        _record(rec, 0)
        _record(rec, 1)
        status, body = _get(f"{base}/kairos/steps?since=1")
        page = parse_steps_page(json.dumps(body))
        assert status == 200 and page.node_id == "d0" and page.next_index == 2
        assert [parse_step_record(s).index for s in page.steps] == [1]
        assert _get(f"{base}/kairos/steps?since=x")[0] == 400
        assert _get(f"{base}/kairos/steps?since=-1")[0] == 400
        assert _get(f"{base}/nope")[0] == 404
    finally:
        server.close()


def test_state_server_without_recorder_says_how_to_turn_it_on() -> None:
    server = StateServer("127.0.0.1", 0)
    try:
        status, body = _get(f"http://127.0.0.1:{server.port}/kairos/steps")
        assert status == 404 and "KAIROS_VLLM_RECORD_STEPS" in body["error"]["message"]
    finally:
        server.close()


def test_state_server_exports_the_step_budget_overruns() -> None:
    server = StateServer("127.0.0.1", 0)

    def overruns() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        return float(
            next(
                line.split()[1]
                for line in text.splitlines()
                if line.startswith(f"{STEP_BUDGET_OVERRUNS_METRIC}_total ")
            )
        )

    try:
        assert overruns() == 0  # exported from the start
        server.count_step_budget_overrun()
        server.count_step_budget_overrun()
        assert overruns() == 2
    finally:
        server.close()


# -- configuration and the node command line -------------------------------------------------------
def test_plugin_config_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("KAIROS_VLLM_CONFIG", "KAIROS_VLLM_STATE_PORT", "KAIROS_VLLM_STEP_LOG", "KAIROS_VLLM_RECORD_STEPS"):
        monkeypatch.delenv(name, raising=False)
    assert PluginConfig.from_env() == PluginConfig()
    assert not PluginConfig().recorder_on
    yaml_file = tmp_path / "kairos.yaml"
    yaml_file.write_text("vllm:\n  state_port: 9000\n  profile: deepseek-v2-lite-a100\n")
    monkeypatch.setenv("KAIROS_VLLM_CONFIG", str(yaml_file))
    monkeypatch.setenv("KAIROS_VLLM_STATE_PORT", "9100")  # the environment wins over the file
    monkeypatch.setenv("KAIROS_VLLM_STEP_LOG", "/tmp/steps.jsonl")
    cfg = PluginConfig.from_env()
    assert (cfg.state_port, cfg.profile, cfg.recorder_on) == (9100, "deepseek-v2-lite-a100", True)
    monkeypatch.setenv("KAIROS_VLLM_STATE_PORT", "70000")
    with pytest.raises(ConfigError, match="STATE_PORT"):
        PluginConfig.from_env()


def test_vllm_node_command_line_on_cpu(tmp_path: Path) -> None:
    spec = VllmNodeSpec(
        node_id="d0",
        role="decode",
        python="/venv/bin/python",
        model_dir=tmp_path / "model",
        served_model_name="tiny",
        port=8101,
        state_port=8201,
        nixl_port=8301,
        workdir=tmp_path,
        step_log=str(tmp_path / "steps.jsonl"),
    )
    argv = spec.argv()
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector",
        # vLLM's NixlConnector with the decode side that pulls a split's prefix (docs/design/split-on-vllm.md)
        "kv_connector_module_path": "kairos.nodeagent.vllm_plugin.split_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_buffer_device": "cpu",
    }
    assert "--kv-cache-memory-bytes" in argv and "--enforce-eager" in argv
    # Prefix caching is vLLM's default, left on; without KV event ports the node publishes none.
    assert "--no-enable-prefix-caching" not in argv and "--kv-events-config" not in argv
    assert "--enable-prompt-tokens-details" in argv and spec.kv_event_endpoints() is None
    env = spec.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["UCX_TLS"] == "tcp,self,sm"
    assert (env["KAIROS_VLLM_STATE_PORT"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("8201", "8301")
    assert env["KAIROS_VLLM_RECORD_STEPS"] == "1"
    gpu = dataclasses.replace(spec, device="gpu")
    assert "--kv-cache-memory-bytes" not in gpu.argv() and "UCX_TLS" not in gpu.env()


def test_vllm_node_publishes_its_kv_events_where_it_says(tmp_path: Path) -> None:
    spec = VllmNodeSpec(
        node_id="d0",
        role="decode",
        python="/venv/bin/python",
        model_dir=tmp_path / "model",
        served_model_name="tiny",
        port=8101,
        state_port=8201,
        nixl_port=8301,
        kv_events_port=8401,
        kv_events_replay_port=8402,
    )
    argv = spec.argv()
    # vLLM binds its PUB socket only to a wildcard endpoint (to tcp://HOST:PORT it connects).
    assert KvEventsConfig.from_json(argv[argv.index("--kv-events-config") + 1]) == KvEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:8401",
        replay_endpoint="tcp://127.0.0.1:8402",
        topic=KV_EVENTS_TOPIC,
    )
    assert spec.kv_event_endpoints() == KvEventEndpoints(
        "tcp://127.0.0.1:8401", "tcp://127.0.0.1:8402", KV_EVENTS_TOPIC
    )
    everywhere = dataclasses.replace(spec, host="0.0.0.0")
    assert json.loads(everywhere.argv()[everywhere.argv().index("--kv-events-config") + 1])["replay_endpoint"] == (
        "tcp://*:8402"
    )
    with pytest.raises(ConfigError, match="the address dispatchers reach it at"):
        everywhere.kv_event_endpoints()
    assert everywhere.kv_event_endpoints("10.0.0.5") == KvEventEndpoints(
        "tcp://10.0.0.5:8401", "tcp://10.0.0.5:8402", KV_EVENTS_TOPIC
    )
    off = dataclasses.replace(spec, kv_events_port=0, kv_events_replay_port=0, prefix_caching=False)
    assert "--no-enable-prefix-caching" in off.argv() and "--kv-events-config" not in off.argv()
    assert off.kv_event_endpoints() is None
    with pytest.raises(ConfigError, match="KV events need prefix caching"):
        dataclasses.replace(spec, prefix_caching=False)
    with pytest.raises(ConfigError, match="replay port needs"):
        dataclasses.replace(spec, kv_events_port=0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_vllm_clusters_heartbeat_advertises_the_sockets_its_engine_binds(
    tmp_path: Path, prefix_caching: bool
) -> None:
    """VllmCluster gives each node's publisher the engine's own --kv-events-config (not the ports
    LocalCluster plans for an emulated node), so the dispatchers subscribe where vLLM publishes."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    backend = VllmBackend(str(python), prefix_caching=prefix_caching)
    cluster = VllmCluster(LocalClusterConfig(), tmp_path, backend=backend)
    cluster.model_dir = tmp_path / "model"
    node = cluster.plan_nodes()[-1]
    cluster.engine_process(node)
    beat = HEARTBEAT.load(cluster.publisher_argv(node)[-3], environ={})  # its --config file (then --log-level L)
    if not prefix_caching:
        assert node.kv_events is None and beat.kv_events_config == ""
        return
    config = beat.kv_events_config
    publisher = PublisherConfig(node.node_id, node.role, node.url, node.sidecar_url, kv_events_config=config)
    assert publisher.kv_event_endpoints() == cluster.kv_event_endpoints(node) is not None


def test_state_snapshot_carries_each_prefills_computed_prefix_and_the_kv_being_pulled() -> None:
    state = build_state(
        decode_tokens=3,
        kv_tokens=4100,
        kv_capacity_tokens=131072,
        prefills=[PendingPrefill(500, False, 1500), PendingPrefill(900, True, 100), PendingPrefill(7, False)],
        max_step_tokens=2048,
        model="tiny",
        running_requests=4,
        waiting_requests=2,
        kv_usage=0.0312,
        kv_pulls=[3000],
    )
    assert (state.queued_prefill_tokens, state.queued_prefill_computed_tokens) == ((500, 7), (1500, 0))
    assert (state.scheduled_prefill_tokens, state.scheduled_prefill_computed_tokens) == ((900,), (100,))
    assert state.pending_kv_pull_tokens == (3000,)
    assert parse_engine_state(encode_engine_state(state).encode()) == state
