"""Step records from the engine model in virtual time: the collection plan without a server.

:func:`simulate_phase` runs one :mod:`kairos.profiling.plan` phase on a :class:`kairos.sim.engine.Engine`
costed by a profile (``model_step_time``, exactly what an emulated node does), advancing a
virtual clock by each step's duration, and returns the records an emulated node would serve
from ``/kairos/steps`` for it. Fitting such records must give back the profile's own
coefficients: that is the pipeline's end-to-end test. A test utility (it ships in no package):
nothing but the profiling tests runs it.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

from kairos.common.contracts import Role, encode_step_record
from kairos.core.latency import LatencyModels
from kairos.profiling.plan import MicroPhase, Phase, TracePhase
from kairos.profiling.records import MANIFEST_FILE
from kairos.sim.engine import Engine, EngineConfig, Sequence, StepTimer, model_step_time

# Virtual seconds a phase may run before it is cut (a plan that never drains is a bug).
MAX_PHASE_S = 1e6


class _Driver:
    def __init__(self, engine: Engine, node: str) -> None:
        self.engine = engine
        self.now = 0.0
        self.records: list[dict[str, Any]] = []
        self.node = node

    def step(self) -> bool:
        """Run one step; False when the engine has nothing to run."""
        plan = self.engine.plan_step(self.now)
        if plan is None:
            return False
        duration = self.engine.step_duration(plan)
        self.now += duration
        self.engine.finish_step(plan, self.now, duration)
        self.records.append(encode_step_record(plan.record(duration, self.node, self.engine.config.role)))
        if self.now > MAX_PHASE_S:
            raise RuntimeError(f"phase ran past {MAX_PHASE_S} virtual seconds")
        return True


def _trace(d: _Driver, phase: TracePhase) -> None:
    pending = deque(phase.requests)
    i = 0
    while pending or d.engine.has_work:
        while pending and pending[0].at <= d.now:
            r = pending.popleft()
            d.engine.submit(Sequence(f"{phase.name}-{i}", r.prompt_tokens, r.max_tokens))
            i += 1
        if not d.step():
            if not pending:
                break
            d.now = max(d.now, pending[0].at)  # idle until the next arrival


def _micro(d: _Driver, phase: MicroPhase) -> None:
    decoders = [Sequence(f"{phase.name}-d{i}", phase.context, phase.decode_max_tokens) for i in range(phase.batch)]
    for seq in decoders:
        d.engine.submit(seq)
    while any(s.generated == 0 for s in decoders) and d.step():
        pass  # step until every decode of the batch is running
    for probe in phase.probes:
        seq = Sequence(f"{phase.name}-chi{probe.chi}", probe.prompt_tokens, 1, schedule=tuple(probe.schedule))
        d.engine.submit(seq)
        while seq.finished_at is None and d.step():
            pass  # step until the probe's last chunk has run
    # The collector cancels the decodes here; their KV leaves with the engine.


def simulate_phase(
    phase: Phase,
    role: str,
    models: LatencyModels,
    max_step_tokens: int = 2048,
    node: str = "virtual",
    timer: StepTimer | None = None,
) -> list[dict[str, Any]]:
    """The step records of ``phase`` on a fresh engine of ``role`` costed by ``models`` (or by
    ``timer``, e.g. a noisy ground truth)."""
    config = EngineConfig(node, Role(role), max_step_tokens=max_step_tokens)
    engine = Engine(config, timer or model_step_time(models))
    d = _Driver(engine, node)
    if isinstance(phase, TracePhase):
        _trace(d, phase)
    else:
        _micro(d, phase)
    return d.records


def write_runs(
    out_dir: Path,
    phases: list[Phase],
    role: str,
    models: LatencyModels,
    max_step_tokens: int = 2048,
    timer: StepTimer | None = None,
) -> list[Path]:
    """Simulate each phase into ``out_dir/<phase>.jsonl`` with a manifest, as a collection would."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for phase in phases:
        path = out_dir / f"{phase.name}.jsonl"
        records = simulate_phase(phase, role, models, max_step_tokens, timer=timer)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    manifest = {
        "source": "virtual",
        "role": role,
        "model": models.model,
        "profile": models.name,
        "phases": {p.name: {"kind": p.kind, "file": f"{p.name}.jsonl", "status": "complete"} for p in phases},
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return paths
