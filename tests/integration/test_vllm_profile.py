"""``kairos profile`` against real vLLM: the step recorder's records feed collect and fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kairos.core.latency import load_profile
from kairos.launcher.vllm_cluster import VllmCluster
from kairos.profiling.collect import CollectConfig, run_collect
from kairos.profiling.fit import ProfileMeta, fit_profile
from kairos.profiling.plan import PlanConfig

pytestmark = pytest.mark.vllm


def test_collect_and_fit_on_a_real_decode_node(vllm_cluster: VllmCluster, tmp_path: Path) -> None:
    out = tmp_path / "d0"
    plan = PlanConfig(
        role="decode",
        rates=(4.0,),
        duration_s=4,
        max_prompt_tokens=1500,
        max_output_tokens=16,
        batch_sizes=(2,),
        contexts=(16384,),  # scaled like every prompt: 16384 x 1500 / 32768 = 750 cached tokens
        chunks=(66, 130),
    )
    summary = run_collect(
        CollectConfig(
            node=vllm_cluster.node("d0").url,
            out_dir=out,
            plan=plan,
            budget_s=120,
            step_log=Path(vllm_cluster.specs["d0"].step_log),
        ),
        progress=lambda _: None,
    )
    assert summary.complete, summary.incomplete
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["step_source"].startswith("file:") and manifest["model"] == "kairos-tiny-llama"

    micro = [json.loads(line) for line in (out / "micro-b2-k16384.jsonl").read_text().splitlines()]
    # The probes ran as scheduled prefills beside the 2 running decodes: chunks of chi - B tokens.
    probe_chunks = {ch["tokens"] for s in micro if s["decode_tokens"] == 2 for ch in s["chunks"]}
    assert {64, 128} <= probe_chunks, probe_chunks

    result = fit_profile([out], ProfileMeta("tiny-vllm-cpu"), load_profile())
    assert {"decode_step", "mixed_increment"} <= set(result.fitted)
    decode = result.profile.decode
    # Timings on a starved CPU host are noise-dominated: what holds whatever they are is that the
    # fit has the samples and a physical model (no negative fixed cost, no negative feature cost).
    assert decode.samples and decode.samples > 20
    assert decode.intercept >= 0 and all(x >= 0 for x in decode.coefficients)
    assert result.profile.provenance["measured"] is True
