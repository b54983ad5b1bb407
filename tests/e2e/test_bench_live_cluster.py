"""The live benchmarks' cluster (bench/harness/live_cluster.py ``live_cluster``, which
bench.live.replay, prefix, keep_estimate and slo_classes start theirs with): a real local 2P2D
cluster that serves through Envoy with its stand-ins for other machines above the gateway under
the fair harness, and that gives every priority back and stops every process when the benchmark
is done with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.harness.live_cluster import live_cluster, stand_in_pids
from kairos.common.contracts import Role
from tests.e2e.conftest import post_json

MODEL = "kairos-tiny-llama"


def _policy(pid: int) -> int:
    return os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK


def test_the_fair_harness_raises_the_stand_ins_not_the_gateway_and_undoes_it(tmp_path: Path, model_dir: Path) -> None:
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    with live_cluster("pd", model_dir, 2.0, tmp_path / "cluster", harness="fair") as (cluster, priority):
        stand_ins = stand_in_pids(cluster)
        decode = [n for n in cluster.nodes if n.role == Role.DECODE]
        assert len(stand_ins) == len(cluster.nodes) * 2 + len(decode) + 1  # engines, publishers, sidecars, Redis
        assert cluster.envoy is not None
        gateway = [p.pid for p in cluster.dispatcher_procs] + [cluster.envoy.pid]
        # Where the rights are missing (no CAP_SYS_NICE) the harness says so and raises nothing.
        raised = priority.endswith("SCHED_RR")
        for pid in stand_ins:
            assert _policy(pid) == (os.SCHED_RR if raised else os.SCHED_OTHER)
        for pid in gateway:
            assert _policy(pid) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, pid) == own_nice
        request = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3}
        status, _, body = post_json(f"{cluster.gateway_url}/v1/completions", request)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3
        procs = list(cluster.group.procs)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice
    assert procs and not any(p.alive() for p in procs)


def test_an_unknown_harness_is_refused_before_anything_starts(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="harness"), live_cluster("pd", model_dir, 2.0, tmp_path / "c", harness="fast"):
        pass
    assert not (tmp_path / "c").exists()
