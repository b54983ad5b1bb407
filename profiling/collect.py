"""Drive a running node through a profiling plan and keep its step records:
``kairos profile collect --node URL --role prefill|decode --out DIR``.

The node is anything that speaks vLLM's OpenAI HTTP API: an emulated node
(``python -m kairos.sim.emulated_vllm``) or real vLLM. Prompts are sent as token ids (exact lengths on
any tokenizer; random ids per request, so prefix caching never shortens a prefill), with
``ignore_eos`` so completions run to ``max_tokens``. The microbenchmark's chunk schedule goes in
``vllm_xargs.kairos_chunk_schedule``, which the emulated node and vLLM with the Kairos scheduler
plugin both honour.

Step records come from ``GET /kairos/steps?since=N`` (the emulated node), polled while a phase
runs so the node's bounded step log never overflows, or from the step recorder's JSONL file
(``--step-log FILE``, real vLLM; it wins when given). Their durations are model seconds: an
emulated node run with ``--time-scale S`` sleeps ``duration / S`` but records ``duration``
(``kairos.sim.realtime``), and trace arrivals, planned in model seconds, are sent ``S`` times faster
(``--time-scale`` here must match the node's).

Each phase writes ``DIR/<phase>.jsonl`` (one run for the fitter) and updates
``DIR/manifest.json``; ``--resume`` skips phases already complete (file present, checksum
matching). The whole collection stops at ``--budget-s`` wall seconds: the phase it cuts is kept
as "partial" (its steps are valid records) and rerun by the next ``--resume``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kairos.common import contracts as c
from kairos.common.contracts.api import COMPLETIONS_PATH, MODELS_PATH
from kairos.common.errors import ConfigError, KairosError
from kairos.profiling.plan import MicroPhase, Phase, PlanConfig, TracePhase, plan_phases
from kairos.profiling.records import MANIFEST_FILE, RecordsError, file_sha256, parse_step

MANIFEST_VERSION = 1
MIN_PHASE_S = 1.0  # wall seconds of budget below which no new phase starts
SETTLE_S = 0.2  # wall seconds for a step log to flush a phase's last steps


class CollectError(KairosError):
    """The node cannot be driven or its step records cannot be read."""

    code = "collect_failed"


@dataclass(frozen=True)
class CollectConfig:
    """One collection against one node."""

    node: str  # base URL of the node's OpenAI server, e.g. http://127.0.0.1:8101
    out_dir: Path  # run files and manifest.json
    plan: PlanConfig  # what to run (its max_model_len is replaced by the node's when reported)
    budget_s: float = 1800.0  # wall seconds for the whole collection (paper §5.1: about 30 min)
    resume: bool = False  # continue the collection in out_dir, skipping complete phases
    time_scale: float = 1.0  # the emulated node's --time-scale (1 for real vLLM)
    step_log: Path | None = None  # the vLLM step recorder's JSONL file; None = /kairos/steps
    model: str | None = None  # served model name; None = the first of GET /v1/models
    token_ids: tuple[int, int] = (3, 1000)  # prompt token ids are drawn from [lo, hi)
    poll_s: float = 0.25  # wall seconds between step-log polls
    progress_s: float = 2.0  # wall seconds between progress lines

    def __post_init__(self) -> None:
        if not self.node:
            raise ConfigError("node URL must not be empty")
        if not self.node.startswith(("http://", "https://")):
            object.__setattr__(self, "node", f"http://{self.node}")
        object.__setattr__(self, "node", self.node.rstrip("/"))
        if not self.budget_s > 0:
            raise ConfigError(f"budget_s must be > 0, got {self.budget_s}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale}")
        lo, hi = self.token_ids
        if not 0 <= lo < hi:
            raise ConfigError(f"token id range must satisfy 0 <= lo < hi, got {lo}..{hi}")


@dataclass
class PhaseState:
    """Counters of the running phase (printed as progress, stored in the manifest)."""

    sent: int = 0
    done: int = 0
    errors: int = 0
    last_error: str = ""
    steps: int = 0


@dataclass(frozen=True)
class CollectSummary:
    manifest: dict[str, Any]
    ran: tuple[str, ...]  # phases run now, complete or partial
    skipped: tuple[str, ...]  # complete before (--resume)
    incomplete: tuple[str, ...]  # partial or not started: the budget ran out

    @property
    def complete(self) -> bool:
        return not self.incomplete


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Step sources
# ---------------------------------------------------------------------------------------------
class HttpSteps:
    """``GET /kairos/steps?since=N``: a cursor over the node's bounded step log."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.url = http, f"{base}{c.STEPS_PATH}"
        self.cursor = 0
        self.lost = 0  # steps that left the node's log before a poll saw them
        self.node_id: str | None = None

    @property
    def description(self) -> str:
        return f"GET {self.url}"

    async def _get(self, since: int) -> c.StepsPage:
        try:
            async with self.http.get(self.url, params={c.STEPS_SINCE: str(since)}) as resp:
                if resp.status != 200:
                    raise CollectError(f"GET {self.url}: HTTP {resp.status}")
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CollectError(f"GET {self.url}: {exc!r}") from exc
        try:
            page = c.parse_steps_page(raw)
        except c.MalformedStepRecord as exc:
            raise CollectError(f"GET {self.url}: {exc}") from None
        self.node_id = page.node_id or self.node_id
        return page

    async def available(self) -> bool:
        try:
            await self._get(2**62)
        except CollectError:
            return False
        return True

    async def mark(self) -> None:
        self.cursor = (await self._get(2**62)).next_index
        self.lost = 0

    async def fetch(self) -> list[dict[str, Any]]:
        page = await self._get(self.cursor)
        if page.next_index < self.cursor:
            raise CollectError(
                f"{self.url}: the step index went back from {self.cursor} to {page.next_index}: did the node restart?"
            )
        if page.steps and page.steps[0].get(c.StepField.INDEX, self.cursor) > self.cursor:
            self.lost += page.steps[0][c.StepField.INDEX] - self.cursor
        self.cursor = page.next_index
        return list(page.steps)


class FileSteps:
    """A JSONL step log another process appends to (the vLLM step recorder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.line = 0
        self.tail = b""
        self.lost = 0
        self.node_id: str | None = None

    @property
    def description(self) -> str:
        return f"file:{self.path}"

    async def available(self) -> bool:
        return True

    async def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.tail = b""

    async def fetch(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.tail = (self.tail + data).split(b"\n")
        out = []
        for raw in lines:
            self.line += 1
            if not raw.strip():
                continue
            try:
                out.append(json.loads(raw))
            except ValueError as exc:
                raise CollectError(f"{self.path}: a step line is not JSON ({exc}): {raw[:120]!r}") from exc
        return out


StepSource = HttpSteps | FileSteps


# ---------------------------------------------------------------------------------------------
# The collector
# ---------------------------------------------------------------------------------------------
class Collector:
    def __init__(self, cfg: CollectConfig, http: aiohttp.ClientSession, progress: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.http = http
        self.say = progress
        self.model = cfg.model or ""
        self.max_model_len: int | None = None
        self.source: StepSource = FileSteps(cfg.step_log) if cfg.step_log else HttpSteps(http, cfg.node)
        self.rng = np.random.default_rng(cfg.plan.seed)

    # -- node ------------------------------------------------------------------------------
    async def probe_node(self) -> None:
        url = f"{self.cfg.node}{MODELS_PATH}"
        try:
            async with self.http.get(url) as resp:
                if resp.status != 200:
                    raise CollectError(f"GET {url}: HTTP {resp.status}")
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CollectError(f"cannot reach the node at {self.cfg.node} ({exc!r})") from exc
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            raise CollectError(f"GET {url}: no model listed")
        entry = next((m for m in models if m.get("id") == self.cfg.model), None) if self.cfg.model else models[0]
        if entry is None:
            raise CollectError(f"the node serves {[m.get('id') for m in models]}, not {self.cfg.model!r}")
        self.model = str(entry["id"])
        mml = entry.get("max_model_len")
        self.max_model_len = int(mml) if isinstance(mml, int) and mml > 1 else None
        if not await self.source.available():
            raise CollectError(
                f"{self.cfg.node} serves no /kairos/steps step log: pass --step-log FILE, the JSONL file the "
                "node's step recorder writes"
            )

    def plan(self) -> list[Phase]:
        plan = self.cfg.plan
        if self.max_model_len is not None:
            plan = dataclasses.replace(plan, max_model_len=self.max_model_len)
        return plan_phases(plan)

    # -- requests --------------------------------------------------------------------------
    def _body(self, prompt_tokens: int, max_tokens: int, stream: bool, xargs: dict[str, Any] | None) -> dict[str, Any]:
        lo, hi = self.cfg.token_ids
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": self.rng.integers(lo, hi, prompt_tokens).tolist(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # vLLM: run to max_tokens, so output lengths are the plan's
            "stream": stream,
        }
        if xargs:
            body[c.VLLM_XARGS] = xargs
        return body

    def _fail(self, st: PhaseState, message: str) -> None:
        st.errors += 1
        st.last_error = message

    async def _complete(
        self, rid: str, prompt_tokens: int, max_tokens: int, st: PhaseState, xargs: dict[str, Any] | None = None
    ) -> bool:
        st.sent += 1
        url = f"{self.cfg.node}{COMPLETIONS_PATH}"
        try:
            async with self.http.post(
                url, json=self._body(prompt_tokens, max_tokens, False, xargs), headers={c.H_REQUEST_ID: rid}
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    self._fail(st, f"{rid}: HTTP {resp.status}: {raw[:200].decode('utf-8', 'replace')}")
                    return False
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._fail(st, f"{rid}: {exc!r}")
            return False
        st.done += 1
        return True

    async def _decode_stream(
        self, rid: str, prompt_tokens: int, max_tokens: int, first: asyncio.Event, st: PhaseState
    ) -> None:
        """A long streaming request of the microbenchmark's decode batch; ``first`` is set at its
        first token. Runs until cancelled (closing the connection aborts it on the node)."""
        st.sent += 1
        url = f"{self.cfg.node}{COMPLETIONS_PATH}"
        try:
            async with self.http.post(
                url, json=self._body(prompt_tokens, max_tokens, True, None), headers={c.H_REQUEST_ID: rid}
            ) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    self._fail(st, f"{rid}: HTTP {resp.status}: {raw[:200].decode('utf-8', 'replace')}")
                    return
                async for line in resp.content:
                    if line.startswith(b"data:") and not first.is_set():
                        first.set()
            st.done += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._fail(st, f"{rid}: {exc!r}")

    # -- phases ----------------------------------------------------------------------------
    async def _trace(self, phase: TracePhase, deadline: float, st: PhaseState) -> bool:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks: list[asyncio.Task[bool]] = []
        cut = False
        for i, r in enumerate(phase.requests):
            at = t0 + r.at / self.cfg.time_scale
            if at >= deadline:
                cut = True
                break
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            tasks.append(asyncio.create_task(self._complete(f"{phase.name}-{i}", r.prompt_tokens, r.max_tokens, st)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            cut = cut or bool(pending)
        return not cut

    async def _micro(self, phase: MicroPhase, deadline: float, st: PhaseState) -> bool:
        loop = asyncio.get_running_loop()
        firsts = [asyncio.Event() for _ in range(phase.batch)]
        decoders = [
            asyncio.create_task(
                self._decode_stream(f"{phase.name}-d{i}", phase.context, phase.decode_max_tokens, firsts[i], st)
            )
            for i in range(phase.batch)
        ]
        try:
            # The batch first: every decode must be running before a probe is injected.
            while not all(e.is_set() for e in firsts):
                if any(t.done() for t in decoders):
                    raise CollectError(f"{phase.name}: a decode request ended before the batch formed: {st.last_error}")
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(0.01)
            for probe in phase.probes:
                xargs = c.schedule_xargs(probe.schedule)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(
                        self._complete(f"{phase.name}-chi{probe.chi}", probe.prompt_tokens, 1, st, xargs), remaining
                    )
                except TimeoutError:
                    return False
            return True
        finally:
            for t in decoders:
                t.cancel()
            await asyncio.gather(*decoders, return_exceptions=True)

    async def _poll(self, records: list[dict[str, Any]], st: PhaseState, label: str, t0: float) -> None:
        last_print = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.poll_s)
            records.extend(await self.source.fetch())
            st.steps = len(records)
            if time.monotonic() - last_print >= self.cfg.progress_s:
                last_print = time.monotonic()
                self.say(
                    f"[collect] {label}: {st.sent} requests sent, {st.done} done, {st.errors} failed, "
                    f"{st.steps} steps, {time.monotonic() - t0:.1f} s"
                )

    async def run_phase(
        self, phase: Phase, deadline: float, label: str
    ) -> tuple[list[dict[str, Any]], bool, PhaseState]:
        st = PhaseState()
        records: list[dict[str, Any]] = []
        await self.source.mark()
        t0 = time.monotonic()
        poller = asyncio.create_task(self._poll(records, st, label, t0))
        try:
            if isinstance(phase, TracePhase):
                finished = await self._trace(phase, deadline, st)
            else:
                finished = await self._micro(phase, deadline, st)
        finally:
            poller.cancel()
            (polled,) = await asyncio.gather(poller, return_exceptions=True)
        if isinstance(polled, Exception):  # the step log failed mid-phase (not merely cancelled)
            raise polled
        await asyncio.sleep(SETTLE_S)
        records.extend(await self.source.fetch())
        st.steps = len(records)
        if st.sent and st.errors == st.sent:
            raise CollectError(f"{phase.name}: all {st.sent} requests failed; last: {st.last_error}")
        return records, finished, st

    def _run_file(self, phase: Phase, records: list[dict[str, Any]]) -> Path:
        node = self.source.node_id or self.cfg.node
        f = c.StepField
        by_index: dict[tuple[Any, int], dict[str, Any]] = {}
        for i, rec in enumerate(records):
            where = f"{self.source.description} (phase {phase.name}, step {rec.get(f.INDEX, f'#{i}')})"
            try:
                parse_step(rec, where, phase.name, self.cfg.plan.role)
            except RecordsError as exc:
                raise CollectError(exc.message) from exc
            rec = {f.NODE: node, f.ROLE: self.cfg.plan.role, **rec, "phase": phase.name}
            by_index[(rec[f.NODE], rec[f.INDEX])] = rec
        path = self.cfg.out_dir / f"{phase.name}.jsonl"
        tmp = path.with_name(path.name + ".part")
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for _, r in sorted(by_index.items())))
        tmp.replace(path)
        return path


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------
def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _save(path: Path, manifest: dict[str, Any]) -> None:
    manifest["updated_at"] = _now()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


def _load_manifest(cfg: CollectConfig, col: Collector) -> dict[str, Any]:
    path = cfg.out_dir / MANIFEST_FILE
    fresh = {
        "schema_version": MANIFEST_VERSION,
        "tool": "kairos profile collect",
        "created_at": _now(),
        "node": cfg.node,
        "node_id": col.source.node_id,
        "role": cfg.plan.role,
        "model": col.model,
        "max_model_len": col.max_model_len,
        "time_scale": cfg.time_scale,
        "step_source": col.source.description,
        "plan": dataclasses.asdict(cfg.plan),
        "phases": {},
    }
    if not path.exists():
        return fresh
    if not cfg.resume:
        raise CollectError(
            f"{cfg.out_dir} already holds a collection ({MANIFEST_FILE}): pass --resume, or another --out"
        )
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CollectError(f"{path}: unreadable manifest ({exc})") from exc
    for key in ("role", "model"):
        if old.get(key) != fresh[key]:
            raise CollectError(
                f"{path}: the collection there is {key}={old.get(key)!r}, this one {key}={fresh[key]!r}: "
                "use another --out"
            )
    old.setdefault("phases", {})
    return old


def _is_complete(cfg: CollectConfig, entry: dict[str, Any] | None) -> bool:
    if not entry or entry.get("status") != "complete":
        return False
    path = cfg.out_dir / str(entry.get("file"))
    return path.is_file() and file_sha256(path) == entry.get("sha256")


async def collect(cfg: CollectConfig, progress: Callable[[str], None] = _stderr) -> CollectSummary:
    """Run every phase of the plan that is not complete yet, within the budget."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.budget_s
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    # A connection per request: a kept-alive one races the node's idle timeout (vLLM's server closes
    # after 5 s) whenever a phase starts after a pause, and the request then dies unsent with
    # "Can not write request body". The collector's few requests a second do not need the reuse.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        col = Collector(cfg, http, progress)
        await col.probe_node()
        phases = col.plan()
        manifest = _load_manifest(cfg, col)
        manifest_path = cfg.out_dir / MANIFEST_FILE
        ran, skipped, incomplete = [], [], []
        progress(
            f"[collect] {cfg.node} ({cfg.plan.role}, model {col.model}, steps from {col.source.description}): "
            f"{len(phases)} phases, budget {cfg.budget_s:g} s"
        )
        for n, phase in enumerate(phases, 1):
            label = f"{phase.name} ({n}/{len(phases)})"
            if _is_complete(cfg, manifest["phases"].get(phase.name)):
                progress(f"[collect] {label}: already complete, skipped")
                skipped.append(phase.name)
                continue
            if deadline - loop.time() < MIN_PHASE_S:
                progress(f"[collect] {label}: not started, the budget is spent")
                incomplete.append(phase.name)
                continue
            started = time.monotonic()
            records, finished, st = await col.run_phase(phase, deadline, label)
            path = col._run_file(phase, records)
            status = "complete" if finished else "partial"
            manifest["node_id"] = manifest.get("node_id") or col.source.node_id
            manifest["phases"][phase.name] = {
                "kind": phase.kind,
                "params": phase.params(),
                "file": path.name,
                "status": status,
                "steps": len(records),
                "sha256": file_sha256(path),
                "requests": st.sent,
                "failed": st.errors,
                "last_error": st.last_error or None,
                "lost_steps": col.source.lost,
                "wall_s": round(time.monotonic() - started, 3),
                "finished_at": _now(),
            }
            _save(manifest_path, manifest)
            ran.append(phase.name)
            if not finished:
                incomplete.append(phase.name)
            lost = f", {col.source.lost} steps LOST (poll faster)" if col.source.lost else ""
            failed = f", {st.errors} failed (last: {st.last_error})" if st.errors else ""
            progress(f"[collect] {label}: {status}, {len(records)} steps, {st.sent} requests{failed}{lost}")
        _save(manifest_path, manifest)
    return CollectSummary(manifest, tuple(ran), tuple(skipped), tuple(incomplete))


def run_collect(cfg: CollectConfig, progress: Callable[[str], None] = _stderr) -> CollectSummary:
    return asyncio.run(collect(cfg, progress))
