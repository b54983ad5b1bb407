"""The field's own clients count what the gateway counts: vLLM's ``vllm bench serve`` (from
``.venv-vllm``) and inference-perf (from ``.venv-inference-perf``, Python 3.12) through Envoy to
an emulated 2P2D cluster, each client's completed requests and input/output tokens equal to the
dispatchers' decisions and the decode nodes' vLLM counters over its run. A short run of
``bench/live/peer_clients.py`` (which also prints the latency figures side by side)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.live.peer_clients import MODEL, Load, format_report, inference_perf_binary, run_clients
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.tinymodel import build_tiny_model
from tests.integration.conftest import _vllm_python


def _inference_perf() -> str:
    binary = inference_perf_binary()
    if not Path(binary).is_file():
        message = f"no inference-perf at {binary} (bash scripts/inference_perf_env.sh builds it)"
        if os.environ.get("KAIROS_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture
def emulated_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    model_dir = build_tiny_model(tmp_path / "model")
    config = LocalClusterConfig(gateway_port=0, model_dir=str(model_dir), model_name=MODEL, log_level="WARNING")
    cluster = LocalCluster(config, tmp_path / "cluster")
    try:
        cluster.start(timeout_s=120)
        cluster.wait_for_heartbeats(timeout_s=60)
        yield cluster
    finally:
        cluster.stop()


def test_vllm_bench_serve_and_inference_perf_counts_equal_the_gateways(
    emulated_cluster: LocalCluster, tmp_path: Path
) -> None:
    vllm_python, inference_perf = _vllm_python(), _inference_perf()
    # Few, short requests: the counts are the point, not the latencies.
    load = Load(prompts=12, rate=4.0, input_len=128, output_len=8, ip_rate=2.0, ip_duration=4, replay=False)
    out = run_clients(
        emulated_cluster, load, tmp_path / "clients", vllm_python=vllm_python, inference_perf=inference_perf
    )
    report = format_report(out)
    assert set(out["clients"]) == {"vllm_bench_serve", "inference_perf"}, report
    assert out["clients"]["vllm_bench_serve"]["counts"]["completed"] == 12, report
    assert out["clients"]["inference_perf"]["counts"]["completed"] == 8, report
    for name, client in out["clients"].items():
        assert client["ok"], f"{name} disagrees with the gateway:\n{report}"
    ip = out["clients"]["inference_perf"]
    # It took the server's usage, not its own re-tokenization, for every request; and its per-chunk
    # re-tokenization (its token times, so its ITL) finds one token per chunk, as vLLM streams.
    assert ip["client_fallback_requests"] == {"prompt": 0, "output": 0}, report
    assert ip["token_count_mismatches"] == 0, report
