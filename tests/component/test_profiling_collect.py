"""`kairos profile collect` against a real emulated vLLM node process (high --time-scale), with
resume and budget; the step-log file path against a stand-in server without /kairos/steps."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from kairos.common import contracts as c
from kairos.core.latency import load_profile
from kairos.launcher.processes import ManagedProcess, free_port, http_ready
from kairos.launcher.tinymodel import build_tiny_model
from kairos.profiling.__main__ import main
from kairos.profiling.collect import CollectConfig, CollectError, CollectSummary, FileSteps, collect
from kairos.profiling.dataset import profile_predictions, split_by_model
from kairos.profiling.plan import PlanConfig
from kairos.profiling.records import MANIFEST_FILE, StepKind, file_sha256, load_runs

TIME_SCALE = 100.0
TRUTH = load_profile()  # the emulated node's default profile


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("node")
    model_dir = build_tiny_model(work / "model")
    port = free_port()
    proc = ManagedProcess(
        "d0-emulated",
        [sys.executable, "-m", "kairos.sim.emulated_vllm", "--node-id", "d0", "--role", "decode", "--port", str(port),
         "--model-dir", str(model_dir), "--model", "tiny", "--time-scale", str(TIME_SCALE), "--log-level", "WARNING"],
        work / "d0.log",
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
    )  # fmt: skip
    proc.start()
    try:
        proc.wait_ready(30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def plan(**overrides: Any) -> PlanConfig:
    base: dict[str, Any] = dict(
        role="decode", rates=(4.0,), duration_s=10, max_output_tokens=32, max_prompt_tokens=8192,
        batch_sizes=(4,), contexts=(842,), chunks=(256, 1024),
    )  # fmt: skip
    return PlanConfig(**(base | overrides))


def config(node: str, out: Path, **overrides: Any) -> CollectConfig:
    kw: dict[str, Any] = dict(node=node, out_dir=out, plan=plan(), budget_s=60, time_scale=TIME_SCALE, poll_s=0.05)
    return CollectConfig(**(kw | overrides))


async def test_collect_then_resume(node: str, tmp_path: Path) -> None:
    out = tmp_path / "d0"
    lines: list[str] = []
    summary = await collect(config(node, out), lines.append)
    assert summary.ran == ("trace-r4", "micro-b4-k842") and summary.complete
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["role"], manifest["model"], manifest["node_id"]) == ("decode", "tiny", "d0")
    for name, entry in manifest["phases"].items():
        assert entry["status"] == "complete" and entry["lost_steps"] == 0 and entry["failed"] == 0
        assert entry["sha256"] == file_sha256(out / f"{name}.jsonl")
    assert any("micro-b4-k842 (2/2): complete" in line for line in lines)

    runs = {Path(r.run).stem: r for r in load_runs([out])}
    trace, micro = runs["trace-r4"].records, runs["micro-b4-k842"].records
    assert {r.kind for r in trace} >= {StepKind.DECODE, StepKind.MIXED}
    assert all(r.role == "decode" and r.node == "d0" for r in trace + micro)
    # Durations are model seconds whatever the time scale: exactly the node's own step model.
    for name, s in split_by_model(trace + micro).items():
        np.testing.assert_allclose(s.duration, profile_predictions(TRUTH, name, s), rtol=1e-9, err_msg=name)
    # The microbenchmark's probes ran with their chunk schedule: chi - B tokens per step, each
    # step carrying the B = 4 decodes, five chunks.
    for chi in (256, 1024):
        probe = [r for r in micro if any(ch.request_id == f"micro-b4-k842-chi{chi}" for ch in r.chunks)]
        assert [(r.decode_tokens, r.step_tokens) for r in probe] == [(4, chi)] * 5
        assert [r.chunks[0].cached for r in probe] == [i * (chi - 4) for i in range(5)]

    # --resume: nothing left to do, files untouched.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.jsonl")}
    again = await collect(config(node, out, resume=True), lines.append)
    assert again.ran == () and again.skipped == ("trace-r4", "micro-b4-k842")
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.jsonl")} == before
    # A new rate on resume: only its phase runs.
    more = await collect(config(node, out, resume=True, plan=plan(rates=(4.0, 8.0))), lines.append)
    assert more.ran == ("trace-r8",) and more.complete
    # Without --resume an existing collection is not overwritten.
    with pytest.raises(CollectError, match="already holds a collection"):
        await collect(config(node, out), lines.append)
    # A phase whose file changed since is run again.
    (out / "trace-r8.jsonl").write_text("")
    redo = await collect(config(node, out, resume=True, plan=plan(rates=(4.0, 8.0))), lines.append)
    assert redo.ran == ("trace-r8",)


def test_budget_cuts_a_phase_and_resume_finishes(node: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cut"
    args = ["collect", "--node", node.removeprefix("http://"), "--role", "decode", "--out", str(out),
            "--rates", "1", "--duration-s", "200", "--max-prompt-tokens", "2048", "--time-scale", str(TIME_SCALE),
            "--max-output-tokens", "32",
            "--batch-sizes", "4", "--contexts", "842", "--chunks", "256"]  # fmt: skip
    assert main([*args, "--budget-s", "1.6"]) == 1  # 2 s of arrivals: the budget cuts the trace
    err = capsys.readouterr().err
    assert "trace-r1 (1/2): partial" in err and "micro-b4-k842 (2/2): not started" in err and "--resume" in err
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["phases"]["trace-r1"]["status"] == "partial"
    assert manifest["phases"]["trace-r1"]["steps"] > 0  # what ran is kept: valid records
    assert "micro-b4-k842" not in manifest["phases"]
    assert main([*args, "--budget-s", "60", "--resume"]) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert {e["status"] for e in manifest["phases"].values()} == {"complete"}


def test_unreachable_node_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["collect", "--node", f"127.0.0.1:{port}", "--role", "decode", "--out", str(tmp_path)]) == 2
    assert "kairos profile collect: error: cannot reach the node" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Step-log file (real vLLM with the step recorder): a stand-in server without /kairos/steps
# ---------------------------------------------------------------------------------------------
async def _stand_in(
    log: Path | None, dropped: list[str] | None = None
) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """With ``dropped``, the node closes a kept-alive connection unanswered when a second request
    comes on it (an idle timeout racing the request at once) and lists those requests there."""
    bodies: list[dict[str, Any]] = []
    index = [0]
    served: set[object] = set()  # the transports themselves: an id is reused once one is freed

    @web.middleware
    async def idle_timeout(request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        if dropped is not None and transport is not None:
            if transport in served:
                dropped.append(request.path)
                transport.close()
                raise web.HTTPServiceUnavailable()  # never written: the connection is gone
            served.add(transport)
        return await handler(request)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "real-model", "max_model_len": 4096}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        if log is not None:  # one prefill step per request, as a recorder would write it (plus its own keys)
            rec = {"index": index[0], "start": 0.1 * index[0], "duration": 0.01, "decode_tokens": 0,
                   "kv_tokens": 0, "chunks": [{"request_id": "x", "tokens": len(body["prompt"]), "cached": 0}],
                   "node": "vllm-0", "wall_start": 1.7e9}  # fmt: skip
            index[0] += 1
            with log.open("a") as f:  # written in two parts: the reader must wait for the newline
                line = json.dumps(rec)
                f.write(line[:10])
                f.flush()
                f.write(line[10:] + "\n")
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application(middlewares=[idle_timeout])
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", bodies


async def _collect_a_prefill_phase(
    tmp_path: Path, log: Path, dropped: list[str] | None = None
) -> tuple[CollectSummary, list[dict[str, Any]]]:
    """One short prefill phase against the stand-in, into ``tmp_path / "out"``; the summary and
    the bodies the stand-in was sent."""
    runner, url, bodies = await _stand_in(log, dropped)
    try:
        cfg = config(url, tmp_path / "out", step_log=log, time_scale=10.0,
                     plan=PlanConfig(role="prefill", rates=(20.0,), duration_s=1.0, max_prompt_tokens=512))  # fmt: skip
        return await collect(cfg, lambda _: None), bodies
    finally:
        await runner.cleanup()


async def test_step_log_file_source(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"index": 99, "start": 0, "duration": 0.5, "decode_tokens": 1, "kv_tokens": 1,
                               "chunks": []}) + "\n")  # fmt: skip  # an older step: not this phase's
    summary, bodies = await _collect_a_prefill_phase(tmp_path, log)
    assert summary.complete
    (run,) = load_runs([tmp_path / "out"])
    assert len(run.records) == len(bodies) > 5
    assert {r.node for r in run.records} == {"vllm-0"} and {r.kind for r in run.records} == {StepKind.PREFILL}
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert manifest["step_source"] == f"file:{log}" and manifest["max_model_len"] == 4096
    # What a real vLLM node is sent: token ids (no prefix shared), max_tokens 1 on a prefill node,
    # prompt lengths scaled to the cap.
    assert all(b["model"] == "real-model" and b["max_tokens"] == 1 and b["ignore_eos"] for b in bodies)
    assert all(isinstance(t, int) for b in bodies for t in b["prompt"])
    assert max(len(b["prompt"]) for b in bodies) <= 512
    assert len({tuple(b["prompt"][:16]) for b in bodies}) == len(bodies)


async def test_a_node_closing_kept_alive_connections_loses_no_request(tmp_path: Path) -> None:
    # vLLM's server closes a connection idle for 5 s; a phase that starts after a pause must not
    # send its requests into connections the node has just closed.
    log = tmp_path / "steps.jsonl"
    dropped: list[str] = []
    summary, bodies = await _collect_a_prefill_phase(tmp_path, log, dropped)
    assert dropped == [] and summary.complete
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert [entry["failed"] for entry in manifest["phases"].values()] == [0]
    assert len(load_runs([tmp_path / "out"])[0].records) == len(bodies) > 5


async def test_a_node_without_a_step_log_needs_step_log(tmp_path: Path) -> None:
    runner, url, _ = await _stand_in(None)
    try:
        with pytest.raises(CollectError, match="serves no /kairos/steps step log: pass --step-log"):
            await collect(config(url, tmp_path / "out", plan=plan(micro=False)), lambda _: None)
    finally:
        await runner.cleanup()


async def test_file_steps_reads_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    src = FileSteps(path)
    await src.mark()  # no file yet: starts at 0
    assert await src.fetch() == []
    path.write_text('{"index": 0}\n{"ind')
    assert await src.fetch() == [{"index": 0}]
    with path.open("a") as f:
        f.write('ex": 1}\n')
    assert await src.fetch() == [{"index": 1}]
    await src.mark()
    with path.open("a") as f:
        f.write("not json\n")
    with pytest.raises(CollectError, match="not JSON"):
        await src.fetch()


def test_schedule_goes_in_vllm_xargs() -> None:
    assert c.XARG_CHUNK_SCHEDULE == "kairos_chunk_schedule"  # what the node and the plugin read
