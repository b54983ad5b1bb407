"""Where and how a benchmark writes its figures: the JSON under bench/results/ with when, where and
what ran it, and percentile summaries of timed samples."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=float) / 1e3
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
        "samples": int(a.size),
    }


def write_result(name: str, payload: dict[str, Any], out: Path | None = None) -> Path:
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path
