"""The step recorder: one record per engine step, for profiling (off by default).

A record is :func:`kairos.common.contracts.encode_step_record` of the step, with this node's id,
as the emulated node serves them and the profiler reads them. The recorder keeps the last
``ring`` records for ``/kairos/steps?since=N`` and, given a path, appends each one to a JSONL
file (line-buffered: a crash loses at most the line being written).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any

import msgspec

from kairos.common.contracts import EngineStep, StepField, encode_step_record


class StepRecorder:
    def __init__(self, ring: int, path: str | Path | None = None, node: str = "") -> None:
        self._ring: deque[dict[str, Any]] = deque(maxlen=ring)
        self._lock = threading.Lock()  # the scheduler thread appends, the HTTP thread reads
        self.node = node
        self.next_index = 0  # one past the newest record's index
        self._file: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the engine

    def record(self, step: EngineStep) -> None:
        rec = encode_step_record(msgspec.structs.replace(step, node=self.node))
        with self._lock:
            self._ring.append(rec)
            self.next_index = step.index + 1
        if self._file is not None:
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def since(self, index: int) -> list[dict[str, Any]]:
        """Records with ``index >= index``, oldest first."""
        with self._lock:
            return [r for r in self._ring if r[StepField.INDEX] >= index]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
