"""The step recorder: one record per engine step, for profiling (off by default).

A record has the schema the emulated node serves at ``/kairos/steps`` (``index``, ``start``,
``duration`` in seconds, ``decode_tokens``, ``kv_tokens`` at the step's start, ``chunks`` with
each prefill's ``request_id``, ``tokens`` and ``cached`` tokens), plus ``node``. The recorder
keeps the last ``ring`` records for ``/kairos/steps?since=N`` and, given a path, appends each
one to a JSONL file (line-buffered: a crash loses at most the line being written).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any


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

    def record(
        self,
        *,
        index: int,
        start: float,
        duration: float,
        decode_tokens: int,
        kv_tokens: int,
        chunks: list[dict[str, Any]],
    ) -> None:
        rec = {
            "index": index,
            "start": start,
            "duration": duration,
            "decode_tokens": decode_tokens,
            "kv_tokens": kv_tokens,
            "chunks": chunks,
            "node": self.node,
        }
        with self._lock:
            self._ring.append(rec)
            self.next_index = index + 1
        if self._file is not None:
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def since(self, index: int) -> list[dict[str, Any]]:
        """Records with ``index >= index``, oldest first."""
        with self._lock:
            return [r for r in self._ring if r["index"] >= index]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
