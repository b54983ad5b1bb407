"""`kairos replay`'s vLLM figures equal what vLLM's own `vllm bench serve` code computes from the
same requests: its ``calculate_metrics`` runs in the vLLM environment on our records."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from kairos.launcher.replay import RequestResult
from kairos.launcher.serving_metrics import PERCENTILES, Goodput, field_metrics
from tests.integration.conftest import _vllm_python

# Runs in .venv-vllm: builds vLLM's RequestFuncOutput from each record and prints its metrics.
VLLM_SIDE = r"""
import dataclasses, json, sys
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
from vllm.benchmarks.serve import calculate_metrics

doc = json.load(sys.stdin)
outputs = [
    RequestFuncOutput(
        success=r["ok"], latency=r["e2e_s"] or 0.0, output_tokens=r["n"], ttft=r["ttft_s"] or 0.0,
        itl=[g / 1e3 for g in r["tbt_ms"]], prompt_len=r["prompt_tokens"], start_time=r["arrival_s"],
    )
    for r in doc["records"]
]
metrics, _ = calculate_metrics(
    input_requests=[], outputs=outputs, dur_s=doc["duration"], tokenizer=None,
    selected_percentiles=doc["percentiles"], goodput_config_dict=doc["goodput"],
)
print(json.dumps(dataclasses.asdict(metrics)))
"""


def _records(n: int, seed: int) -> list[RequestResult]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = rng.choice([1, 2, rng.randint(3, 40)])
        gaps = [rng.uniform(5.0, 120.0) for _ in range(tokens - 1)]
        ttft = rng.uniform(0.05, 6.0)
        tail = rng.uniform(0.0, 0.05)
        r = RequestResult(f"r{i}", i * 0.25, rng.randint(10, 9000), tokens, status=200, tokens=tokens)
        r.ttft_s, r.tbt_ms, r.e2e_s = ttft, gaps, ttft + sum(gaps) / 1e3 + tail
        r.usage = {"prompt_tokens": r.prompt_tokens, "completion_tokens": tokens}
        if rng.random() < 0.1:
            r.status, r.error, r.usage = 503, "HTTP 503", None
        out.append(r)
    return out


def test_replay_figures_equal_vllm_bench_serve_calculate_metrics(tmp_path: Path) -> None:
    records = _records(400, seed=1)  # one run: importing vLLM takes half a minute
    goodput = Goodput.parse(["ttft:3000", "tpot:60", "e2el:6000"])
    duration = 60.0
    ours = field_metrics(records, goodput, duration)["vllm"]
    payload = {
        "records": [
            {**r.to_json(), "tbt_ms": r.tbt_ms, "n": (r.usage or {}).get("completion_tokens", 0)} for r in records
        ],
        "duration": duration,
        "percentiles": list(PERCENTILES),
        "goodput": {"ttft": 3000.0, "tpot": 60.0, "e2el": 6000.0},
    }
    proc = subprocess.run(
        [_vllm_python(), "-c", VLLM_SIDE],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])

    assert ours["completed"] == theirs["completed"] and ours["failed"] == theirs["failed"]
    assert ours["total_input_tokens"] == theirs["total_input"]
    assert ours["total_output_tokens"] == theirs["total_output"]
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-12), key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = ours[f"{metric}_ms"]
        for stat in ("mean", "median", "std"):
            assert stats[stat] == pytest.approx(theirs[f"{stat}_{metric}_ms"], rel=1e-9), (metric, stat)
        for q, value in theirs[f"percentiles_{metric}_ms"]:
            assert stats[f"p{q:g}"] == pytest.approx(value, rel=1e-9), (metric, q)
