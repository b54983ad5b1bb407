"""`kairos replay` against a real local cluster: a short bursty trace with small prompts, sent open
loop through Envoy; every request must come back with the trace's exact token counts. Then short
conversations, each turn sent after the previous answer with that answer in its prompt."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kairos.common.contracts.routes import Route
from kairos.core.slo import classify
from kairos.launcher.cli import main as kairos_main
from kairos.launcher.replay import ReplayConfig, format_summary, replay, summarize
from kairos.traffic.requests import RequestSpec
from kairos.traffic.traces import write_jsonl
from kairos.traffic.workloads import (
    ConversationSpec,
    Geometric,
    LogNormal,
    generate_conversations,
    make_class_mix,
    make_workload,
)
from tests.e2e.conftest import start_cluster

TIME_SCALE = 2.0


def _small_trace(n: int = 30) -> list[RequestSpec]:
    """Bursty arrivals at 4 RPS, prompts folded into [100, 3300) tokens and completions capped at
    24, so the trace mixes short (deflected) and long (kept) prompts and stays a few seconds long."""
    base = make_workload("bursty", rps=4.0, num_requests=n, seed=7)
    return [
        RequestSpec(r.request_id, r.arrival_s, 100 + r.prompt_tokens % 3200, min(r.output_tokens, 24)) for r in base
    ]


def test_replay_sends_the_trace_and_measures_every_request(tmp_path: Path, model_dir: Path) -> None:
    trace = _small_trace()
    trace_path = tmp_path / "trace.jsonl"
    write_jsonl(trace_path, trace)
    out = tmp_path / "replay.json"
    cluster = start_cluster(tmp_path / "cluster", model_dir, time_scale=TIME_SCALE)
    try:
        rc = kairos_main(
            [
                "replay",
                "--url",
                cluster.gateway_url,
                "--model-dir",
                str(model_dir),
                "--trace",
                str(trace_path),
                "--time-scale",
                str(TIME_SCALE),
                "--request-timeout",
                "30",
                "--deadline",
                "60",
                "--goodput",
                "ttft:60000",
                "tpot:10000",
                "--plots",
                str(tmp_path / "plots"),
                "--json",
                str(out),
                "--quiet",
            ]
        )
    finally:
        cluster.stop()
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"config", "summary", "requests"}
    summary, records = doc["summary"], doc["requests"]
    for key in (
        "requests",
        "ok",
        "errors",
        "deflections",
        "keeps",
        "p50_ttft_s",
        "p95_ttft_s",
        "p99_ttft_s",
        "p50_tbt_ms",
        "p95_tbt_ms",
        "p99_tbt_ms",
        "slo_attainment",
        "per_route",
    ):
        assert key in summary, key
    assert summary["requests"] == summary["ok"] == len(trace) and summary["errors"] == 0

    by_id = {r.request_id: r for r in trace}
    assert [r["request_id"] for r in records] == [r.request_id for r in trace]
    for rec in records:
        spec = by_id[rec["request_id"]]
        assert rec["ok"] and rec["status"] == 200 and rec["error"] == "", rec
        assert rec["usage"]["prompt_tokens"] == spec.prompt_tokens, rec
        assert rec["usage"]["completion_tokens"] == spec.output_tokens, rec
        assert rec["tokens"] == spec.output_tokens
        assert rec["route"] in ("keep", "deflect") and rec["decode_node"] in ("d0", "d1"), rec
        assert rec["ttft_s"] > 0
        assert len(rec["tbt_ms"]) == spec.output_tokens - 1
        assert all(g > 0 for g in rec["tbt_ms"])

    per_route = summary["per_route"]
    assert set(per_route) == {route.value for route in Route}  # every route, the split's empty (off by default)
    assert per_route["keep"]["requests"] + per_route["deflect"]["requests"] == len(trace)
    assert (
        per_route["keep"]["requests"] == summary["keeps"] and per_route["deflect"]["requests"] == summary["deflections"]
    )
    assert per_route["split"]["requests"] == summary["splits"] == 0
    assert summary["keeps"] > 0 and summary["deflections"] > 0
    assert 0 < summary["p50_ttft_s"] <= summary["p95_ttft_s"] <= summary["p99_ttft_s"]
    assert 0 < summary["p50_tbt_ms"] <= summary["p95_tbt_ms"] <= summary["p99_tbt_ms"]
    assert 0.0 <= summary["slo_attainment"] <= 1.0

    # The field's figures, per route: every request completed and good under generous limits.
    field = summary["field"]
    assert set(field) == {"all", *(route.value for route in Route)}
    for name, group in (("keep", summary["keeps"]), ("deflect", summary["deflections"]), ("all", len(trace))):
        vllm, ip = field[name]["vllm"], field[name]["inference_perf"]
        assert vllm["completed"] == ip["count"] == group and vllm["failed"] == 0
        assert vllm["request_goodput"] == pytest.approx(vllm["request_throughput"])
        assert vllm["goodput"] == ["ttft:60000", "tpot:10000"]
    everything = field["all"]["vllm"]
    assert everything["total_output_tokens"] == sum(r.output_tokens for r in trace)
    assert everything["total_input_tokens"] == sum(r.prompt_tokens for r in trace)
    assert everything["ttft_ms"]["median"] == pytest.approx(1e3 * float(np.median([r["ttft_s"] for r in records])))
    for name in ("ttft_cdf.png", "latency_over_time.png", "node_load.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_replay_reports_unreachable_gateway_as_errors_within_the_deadline() -> None:
    from kairos.launcher.processes import free_port

    trace = _small_trace(3)
    config = ReplayConfig(url=f"http://127.0.0.1:{free_port()}", request_timeout_s=2.0, deadline_s=10.0)
    results = replay(trace, config, stream=None)
    assert len(results) == 3 and all(not r.ok and r.error for r in results)
    summary = summarize(results, config)
    assert summary["errors"] == 3 and summary["ok"] == 0 and summary["slo_attainment"] == 0.0


# Short conversations: a shared system prompt in most sessions, small messages and answers, a
# second of think time on average (model time), up to four turns each.
CONVERSATIONS = ConversationSpec(
    name="e2e",
    turns=Geometric(p=0.35),
    max_turns=4,
    first_message=LogNormal(mu=math.log(200), sigma=0.5, hi=1500.5),
    next_message=LogNormal(mu=math.log(40), sigma=0.5, hi=300.5),
    answer=Geometric(p=1 / 12),
    think_mean_s=1.0,
    system_prompts=(256, 96),
    system_share=0.75,
)


def test_replay_sends_conversations_turn_after_turn(tmp_path: Path, model_dir: Path) -> None:
    """A JSONL trace of short conversations: every turn is sent, each later turn only after the
    previous answer plus its think time, its prompt the previous prompt + that answer + a new
    message (as long as the workload says, every previous token kept as its prefix), and the
    report splits first and later turns."""
    trace = generate_conversations(CONVERSATIONS, rps=3.0, num_requests=14, seed=3)
    later = [r for r in trace if r.turn >= 2]
    assert len(later) >= 4 and max(r.turn for r in trace) >= 3  # the seed gives real conversations
    trace_path = tmp_path / "conversations.jsonl"
    write_jsonl(trace_path, trace)
    out = tmp_path / "replay.json"
    cluster = start_cluster(tmp_path / "cluster", model_dir, time_scale=TIME_SCALE)
    try:
        rc = kairos_main(
            [
                "replay", "--url", cluster.gateway_url, "--model-dir", str(model_dir), "--trace", str(trace_path),
                "--time-scale", str(TIME_SCALE), "--request-timeout", "60", "--deadline", "240",
                "--plots", str(tmp_path / "plots"), "--json", str(out), "--quiet",
            ]
        )  # fmt: skip
    finally:
        cluster.stop()
    doc = json.loads(out.read_text())
    summary, records = doc["summary"], {r["request_id"]: r for r in doc["requests"]}
    assert rc == 0, summary["error_kinds"]
    assert set(records) == {r.request_id for r in trace} and summary["errors"] == 0

    for spec in trace:
        rec = records[spec.request_id]
        assert rec["ok"] and rec["turn"] == spec.turn and rec["session_id"] == spec.session_id, rec
        # The emulated node answers exactly output_tokens one-token words, so every prompt is as
        # long as the workload planned: previous prompt + answer + the new message.
        assert rec["prompt_tokens"] == rec["usage"]["prompt_tokens"] == spec.prompt_tokens, rec
        if spec.turn == 1:
            assert rec["prefix_tokens"] is None
            continue
        prev_spec = next(r for r in trace if r.request_id == spec.after)
        prev = records[spec.after or ""]
        assert rec["previous_prompt_tokens"] == prev["prompt_tokens"] == rec["prefix_tokens"], rec
        assert spec.prompt_tokens > prev_spec.prompt_tokens + prev_spec.output_tokens
        # Released think_s (model) after the previous answer ended, never before.
        prev_end = prev["arrival_s"] + prev["send_lag_ms"] / 1e3 + prev["e2e_s"]
        assert rec["arrival_s"] >= prev_end + spec.think_s - 1e-6, (rec, prev)

    assert summary["later_turns_sent"] == len(later) and summary["later_turns_prefix_broken"] == 0
    # The nodes cache prefixes and say so (--enable-prompt-tokens-details, as LocalCluster starts
    # them): every answer reports its hit, and a conversation's later turns find some of theirs.
    assert summary["cached_tokens_reported"] == len(trace), summary
    assert any(records[r.request_id]["cached_tokens"] for r in later), [records[r.request_id] for r in later]
    assert summary["p95_ttft_turn1_s"] > 0 and summary["p95_ttft_turn2plus_s"] > 0
    assert (tmp_path / "plots" / "ttft_turns_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_sends_each_requests_slos_and_reports_per_class(tmp_path: Path, model_dir: Path) -> None:
    """The mixed-class workload (small prompts and answers): each request goes out with its class's
    x-slo-ttft-ms / x-slo-tpot-ms, the gateway counts it in that class (x-kairos-slo-class; a
    request without the headers would be 'standard'), and the report gives figures per class."""
    base = make_class_mix("interactive_batch", rps=4.0, duration_s=6.0, seed=5)
    mix = [
        dataclasses.replace(r, prompt_tokens=100 + r.prompt_tokens % 3200, output_tokens=min(r.output_tokens, 16))
        for r in base
    ]
    assert {r.request_id.split("-")[0] for r in mix} == {"interactive", "batch"}
    config = ReplayConfig(model_dir=str(model_dir), time_scale=TIME_SCALE, request_timeout_s=30.0, deadline_s=90.0)
    cluster = start_cluster(tmp_path / "cluster", model_dir, time_scale=TIME_SCALE)
    try:
        config = dataclasses.replace(config, url=cluster.gateway_url)
        results = replay(mix, config, stream=None)
    finally:
        cluster.stop()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    by_id = {r.request_id: r for r in mix}
    for res in results:
        spec = by_id[res.request_id]
        assert (res.ttft_slo_s, res.tpot_slo_s) == (spec.ttft_slo_s, spec.tpot_slo_s)
        assert res.slo_class == classify(spec.ttft_slo_s or 0.0, spec.tpot_slo_s or 0.0), res
        assert res.slo_class == res.request_id.split("-")[0]
    summary = summarize(results, config)
    per_class = summary["per_class"]
    assert list(per_class) == ["interactive", "batch"]
    for name, group in per_class.items():
        assert group["requests"] == sum(r.slo_class == name for r in results) and group["errors"] == 0
        assert 0.0 <= group["slo_attainment"] <= 1.0 and group["p95_ttft_s"] > 0
        mine = [r for r in results if r.slo_class == name]
        assert group["deflections"] == sum(r.route == "deflect" for r in mine)
    assert "interactive" in format_summary(summary)
