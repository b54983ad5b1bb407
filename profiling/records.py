"""Engine step records: the profiler's input, one JSON object per engine step.

The schema is ``kairos.common.contracts``' step record (:class:`~kairos.common.contracts.StepField`,
decoded by :func:`~kairos.common.contracts.parse_step_record`), as the emulated vLLM node serves it
at ``GET /kairos/steps?since=N`` and the vLLM step recorder writes it as JSONL::

    {"index": 17,            # engine step counter (per node)
     "start": 12.031,        # model seconds when the step started
     "duration": 0.0521,     # model seconds the step took
     "decode_tokens": 16,    # B: running decodes in the step, one token each
     "kv_tokens": 57104,     # K: KV tokens held by the node at the step's start
     "chunks": [{"request_id": "r3", "tokens": 512, "cached": 1024}]}   # prefill chunks

Extra keys (``node``, ``role``, ``wall_start``, ``phase``, ...) are allowed; ``role`` (the
node's role, "prefill" or "decode") decides how a chunk-only step is costed, see
:func:`classify`. Times are *model* seconds: an emulated node run with ``--time-scale S``
sleeps ``duration / S`` wall seconds per step but records the model duration, so records are
independent of the time scale (on real vLLM model time is wall time).

A *run* is one file of records: the unit the fitter holds out (split by run, never by row),
because consecutive steps of one run share their batch and are far from independent.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from kairos.common.contracts import MalformedStepRecord, Role, StepChunk, parse_step_record
from kairos.common.errors import KairosError

MANIFEST_FILE = "manifest.json"
TRANSFERS_FILE = "transfers.jsonl"  # KV transfers: {"tokens", "seconds"[, "bytes"]} per line


class RecordsError(KairosError):
    """A step-record file or directory is missing or malformed."""

    code = "invalid_records"


class StepKind(StrEnum):
    PREFILL = "prefill"  # prefill chunks only, on a prefill node: the prefill_step model
    DECODE = "decode"  # decodes only: the decode_step model
    MIXED = "mixed"  # chunks with decodes, or chunks on a decode node: decode_step + mixed_increment
    EMPTY = "empty"  # neither (a recorder's idle tick): no model describes it


def classify(decode_tokens: int, prefill_tokens: int, role: str | None) -> StepKind:
    """Which model costs a step, as the engine model and the dispatcher use them
    (``kairos.sim.engine.model_step_time``): a prefill node's chunk-only steps are prefill steps;
    every other step with chunks is T0(B, K) + Delta T, even with B = 0 on a decode node
    (a deflected prefill running alone). Unknown role: a chunk-only step counts as prefill."""
    if prefill_tokens <= 0:
        return StepKind.DECODE if decode_tokens > 0 else StepKind.EMPTY
    if decode_tokens == 0 and role != Role.DECODE:
        return StepKind.PREFILL
    return StepKind.MIXED


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step."""

    run: str  # run id: the file it came from
    index: int  # engine step counter
    start: float  # model seconds
    duration: float  # model seconds
    decode_tokens: int  # B
    kv_tokens: int  # K at step start
    chunks: tuple[StepChunk, ...]
    role: Role | None = None  # node role, None when neither the record nor the manifest says
    node: str | None = None

    @property
    def prefill_tokens(self) -> int:
        return sum(ch.tokens for ch in self.chunks)

    @property
    def step_tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens

    @property
    def cached(self) -> float:
        """Token-weighted mean cached length of the step's chunks: several chunks are costed as
        one chunk over this mean (``model_step_time``), which keeps ``tokens * cached`` exact."""
        p = self.prefill_tokens
        return sum(ch.tokens * ch.cached for ch in self.chunks) / p if p else 0.0

    @property
    def kind(self) -> StepKind:
        return classify(self.decode_tokens, self.prefill_tokens, self.role)


@dataclass(frozen=True, slots=True)
class RunFile:
    """The records of one file, with what provenance needs."""

    path: Path
    run: str
    sha256: str
    records: tuple[StepRecord, ...]


@dataclass(frozen=True, slots=True)
class TransferRecord:
    run: str
    tokens: int
    seconds: float
    bytes: float | None = None  # measured bytes moved, when the recorder knows them


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _int_field(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise RecordsError(f"{where}: missing key {key!r}")
    v = obj[key]
    if not _is_int(v) or v < minimum:
        raise RecordsError(f"{where}: {key} must be an integer >= {minimum}, got {json.dumps(v)}")
    return int(v)


def parse_step(obj: Any, where: str, run: str, role: str | None = None) -> StepRecord:
    """Validate one step object; ``where`` (``file:line``) starts every error message, ``role``
    (the manifest's) applies when the record names none."""
    try:
        step = parse_step_record(obj)
    except MalformedStepRecord as exc:
        raise RecordsError(f"{where}: {exc}") from None
    return StepRecord(
        run=run,
        index=step.index,
        start=step.start,
        duration=step.duration,
        decode_tokens=step.decode_tokens,
        kv_tokens=step.kv_tokens,
        chunks=step.chunks,
        role=step.role if step.role is not None or role is None else Role(role),
        node=step.node,
    )


def _read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], str]:
    """(line number, parsed object) for every non-blank line, and the file's sha256."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecordsError(f"cannot read {path}: {exc.strerror or exc}") from exc
    rows: list[tuple[int, Any]] = []
    for lineno, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise RecordsError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    return rows, hashlib.sha256(raw).hexdigest()


def load_run(path: Path, run: str | None = None, role: str | None = None) -> RunFile:
    """Load and validate one JSONL file of step records; the run id defaults to the path."""
    path = Path(path)
    run_id = run or str(path)
    rows, sha = _read_jsonl(path)
    records: list[StepRecord] = []
    seen: dict[tuple[str | None, int], int] = {}
    for lineno, obj in rows:
        rec = parse_step(obj, f"{path}:{lineno}", run_id, role)
        key = (rec.node, rec.index)
        if key in seen:
            node = f" of node {rec.node}" if rec.node else ""
            raise RecordsError(f"{path}:{lineno}: step index {rec.index}{node} repeats line {seen[key]}")
        seen[key] = lineno
        records.append(rec)
    return RunFile(path, run_id, sha, tuple(records))


def _manifest_role(directory: Path) -> str | None:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        role = json.loads(path.read_text()).get("role")
    except (OSError, ValueError, AttributeError) as exc:
        raise RecordsError(f"{path}: not a readable manifest ({exc})") from exc
    return role if role in tuple(Role) else None


def record_files(paths: Iterable[Path | str]) -> list[tuple[Path, str | None]]:
    """The step-record files named by ``paths`` (files, or directories whose ``*.jsonl`` files
    are runs; ``transfers.jsonl`` excluded), each with the role its directory's manifest gives."""
    out: list[tuple[Path, str | None]] = []
    for p in map(Path, paths):
        if p.is_dir():
            role = _manifest_role(p)
            files = sorted(f for f in p.glob("*.jsonl") if f.name != TRANSFERS_FILE)
            out.extend((f, role) for f in files)
        elif p.is_file():
            out.append((p, _manifest_role(p.parent)))
        else:
            raise RecordsError(f"{p} does not exist")
    return out


def load_runs(paths: Sequence[Path | str]) -> list[RunFile]:
    """Every run under ``paths``; an error when none holds a single step."""
    files = record_files(paths)
    runs = [load_run(f, role=role) for f, role in files]
    if not any(r.records for r in runs):
        where = ", ".join(map(str, paths))
        raise RecordsError(f"no step records in {where} (expected *.jsonl files of engine steps)")
    return runs


def load_transfers(paths: Sequence[Path | str]) -> list[TransferRecord]:
    """KV-transfer records from ``transfers.jsonl`` in each directory (absent: none); one run
    per file."""
    out: list[TransferRecord] = []
    files = dict.fromkeys((p / TRANSFERS_FILE if p.is_dir() else p.parent / TRANSFERS_FILE) for p in map(Path, paths))
    for path in files:
        if not path.is_file():
            continue
        rows, _ = _read_jsonl(path)
        for lineno, obj in rows:
            where = f"{path}:{lineno}"
            if not isinstance(obj, dict):
                raise RecordsError(f"{where}: a transfer record is a JSON object")
            tokens = _int_field(obj, "tokens", where, 1)
            seconds = obj.get("seconds")
            if not _is_number(seconds) or seconds <= 0:
                raise RecordsError(f"{where}: seconds must be a number > 0, got {json.dumps(seconds)}")
            nbytes = obj.get("bytes")
            if nbytes is not None and (not _is_number(nbytes) or nbytes <= 0):
                raise RecordsError(f"{where}: bytes must be a number > 0, got {json.dumps(nbytes)}")
            out.append(TransferRecord(str(path), tokens, float(seconds), None if nbytes is None else float(nbytes)))
    return out


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
